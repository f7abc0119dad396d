"""Enqueue into the outbox through the application's own database connection.

A web app using Django, SQLAlchemy, psycopg or sqlite3 writes its rows on its own
connection; ``enqueue_on`` adds the message to MeshForge's outbox table with that same
cursor, so the message commits or rolls back with the request's transaction. The
outbox table must exist (``meshforge relay`` creates it when it opens the store, as does
``open_store``), and the relay must use the same database.

Example (Django)::

    from django.db import connection, transaction

    with transaction.atomic():
        order = Order.objects.create(sku="A-1", qty=2)
        with connection.cursor() as cursor:
            enqueue_on(cursor, "cmd.default.shop.inventory.reserve",
                       Envelope.new("inventory.reserve", {"order_id": order.pk}),
                       dialect=connection.vendor, paramstyle="format")
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal, Protocol

from meshforge.envelope import Envelope
from meshforge.errors import ConfigError
from meshforge.store.sql import dump_headers, sqlite_ts_in
from meshforge.topology.subjects import validate_subject

__all__ = ["enqueue_on"]

_INSERT = (
    "INSERT INTO meshforge_outbox (msg_id, subject, data, headers, state, attempts,"
    " created_at, updated_at) VALUES (?, ?, ?, ?, 'pending', 0, ?, ?)"
)


class Cursor(Protocol):
    """A DB-API cursor: Django's, psycopg's, sqlite3's, SQLAlchemy's raw one."""

    def execute(self, sql: str, params: Any = ..., /) -> Any: ...


def enqueue_on(
    cursor: Cursor,
    subject: str,
    envelope: Envelope,
    *,
    dialect: Literal["postgresql", "sqlite"] | str = "postgresql",
    paramstyle: Literal["format", "qmark"] | None = None,
) -> None:
    """Add ``envelope`` for ``subject`` to the outbox using the caller's ``cursor``.

    ``dialect`` is the database (Django's ``connection.vendor`` fits); ``paramstyle`` is
    how the cursor writes placeholders: ``format`` (``%s``: psycopg, Django on any
    database) or ``qmark`` (``?``: sqlite3); by default the dialect's driver's own.
    """
    validate_subject(subject)
    now = datetime.now(UTC)
    if dialect == "postgresql":
        stamp: Any = now
    elif dialect == "sqlite":
        stamp = sqlite_ts_in(now)
    else:
        raise ConfigError(f"outbox dialect: expected 'postgresql' or 'sqlite', got {dialect!r}")
    style = paramstyle or ("format" if dialect == "postgresql" else "qmark")
    if style not in ("format", "qmark"):
        raise ConfigError(f"outbox paramstyle: expected 'format' or 'qmark', got {style!r}")
    sql = _INSERT.replace("?", "%s") if style == "format" else _INSERT
    cursor.execute(
        sql,
        (envelope.id, subject, envelope.encode(), dump_headers(envelope.headers()), stamp, stamp),
    )
