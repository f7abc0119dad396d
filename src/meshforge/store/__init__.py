"""The persistent store: inbox, effects, events, state, outbox and nodes, in one transaction.

Example::

    from meshforge.store import open_store

    store = open_store("sqlite:///.meshforge/store.db")
    with store.transaction() as tx:
        tx.execute("CREATE TABLE IF NOT EXISTS notes (body TEXT)")
        tx.outbox_add(msg_id="n-1", subject="evt.default.demo.note.added", data=b"{}", headers={})
    store.close()
"""

from __future__ import annotations

from meshforge.errors import ConfigError, StoreError, one_line
from meshforge.store.base import (
    DialectName,
    EffectRecord,
    InboxRecord,
    InboxStatus,
    NewEffect,
    NewEvent,
    NewState,
    NodeInfo,
    OutboxMessage,
    OutboxRow,
    OutboxState,
    Store,
    StoredEvent,
    StoredOutput,
    Transaction,
)
from meshforge.store.core import DURABILITIES, Clock, Durability
from meshforge.store.sql import redact, url_error

__all__ = [
    "DURABILITIES",
    "Clock",
    "DialectName",
    "Durability",
    "EffectRecord",
    "InboxRecord",
    "InboxStatus",
    "NewEffect",
    "NewEvent",
    "NewState",
    "NodeInfo",
    "OutboxMessage",
    "OutboxRow",
    "OutboxState",
    "Store",
    "StoredEvent",
    "StoredOutput",
    "Transaction",
    "open_existing_store",
    "open_store",
]


def open_store(url: str, *, clock: Clock | None = None, durability: Durability = "sync") -> Store:
    """Open (and create or migrate) the store at ``url``.

    ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db``, ``sqlite:///:memory:``
    or ``postgresql://user@host:5432/db``. A URL of any other form raises ``ConfigError``;
    an unreachable database raises ``StoreError``. ``clock`` (returning an aware UTC
    datetime) replaces the system clock, for tests of leases and retention.
    ``durability`` says what a commit survives (docs/STORE.md "Durability"): ``"sync"``
    a power cut, ``"os"`` a killed process only.
    """
    if not isinstance(url, str) or not url.strip():
        raise url_error(str(url), "no store URL given")
    if durability not in DURABILITIES:
        raise ConfigError(f"durability must be sync or os, got {durability!r}")
    if url.startswith("sqlite:"):
        from meshforge.store.sqlite import SqliteStore

        return SqliteStore(url, clock=clock, durability=durability)
    if url.startswith(("postgresql:", "postgres:")):
        from meshforge.store.postgres import PostgresStore

        return PostgresStore(url, clock=clock, durability=durability)
    raise url_error(url, "unknown scheme")


def open_existing_store(url: str, *, clock: Clock | None = None) -> Store:
    """Open a store that must already exist, for commands that only read one.

    A missing SQLite file, or a PostgreSQL database (schema) without MeshForge's tables,
    is a ``ConfigError`` naming it, and nothing is created.
    """
    if isinstance(url, str) and url.startswith("sqlite:"):
        from pathlib import Path

        from meshforge.store.sqlite import MEMORY
        from meshforge.store.sqlite import parse_url as sqlite_url

        path = sqlite_url(url)[0]
        if path == MEMORY or not Path(path).is_file():
            raise ConfigError(
                f"no store at {path}: give the --store (MESHFORGE_STORE_URL) the worker used"
            )
    elif isinstance(url, str) and url.startswith(("postgresql:", "postgres:")):
        import psycopg

        from meshforge.store.postgres import parse_url as pg_url

        conninfo, schema, _ = pg_url(url)
        table = f'"{schema}".meshforge_schema_version' if schema else "meshforge_schema_version"
        try:
            with psycopg.connect(conninfo, connect_timeout=10) as conn:
                row = conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()
        except psycopg.Error as exc:
            raise StoreError(
                f"cannot open PostgreSQL store {redact(url)}: {one_line(exc)}"
            ) from exc
        if row is None or row[0] is None:
            raise ConfigError(
                f"no MeshForge store in {redact(url)}: give the --store (MESHFORGE_STORE_URL) the worker used"
            )
    return open_store(url, clock=clock)
