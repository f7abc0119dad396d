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

from meshforge.store.base import (
    DialectName,
    EffectRecord,
    InboxRecord,
    InboxStatus,
    NewEvent,
    NodeInfo,
    OutboxRow,
    OutboxState,
    Store,
    StoredEvent,
    StoredOutput,
    Transaction,
)
from meshforge.store.core import Clock
from meshforge.store.sql import url_error

__all__ = [
    "Clock",
    "DialectName",
    "EffectRecord",
    "InboxRecord",
    "InboxStatus",
    "NewEvent",
    "NodeInfo",
    "OutboxRow",
    "OutboxState",
    "Store",
    "StoredEvent",
    "StoredOutput",
    "Transaction",
    "open_store",
]


def open_store(url: str, *, clock: Clock | None = None) -> Store:
    """Open (and create or migrate) the store at ``url``.

    ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db``, ``sqlite:///:memory:``
    or ``postgresql://user@host:5432/db``. A URL of any other form raises ``ConfigError``;
    an unreachable database raises ``StoreError``. ``clock`` (returning an aware UTC
    datetime) replaces the system clock, for tests of leases and retention.
    """
    if not isinstance(url, str) or not url.strip():
        raise url_error(str(url), "no store URL given")
    if url.startswith("sqlite:"):
        from meshforge.store.sqlite import SqliteStore

        return SqliteStore(url, clock=clock)
    if url.startswith(("postgresql:", "postgres:")):
        from meshforge.store.postgres import PostgresStore

        return PostgresStore(url, clock=clock)
    raise url_error(url, "unknown scheme")
