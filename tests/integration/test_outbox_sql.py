"""``enqueue_on``: the message commits or rolls back with the application's own transaction."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import psycopg
import pytest

from meshforge.config import Settings
from meshforge.envelope import Envelope, decode
from meshforge.publish.outbox import OutboxRelay
from meshforge.publish.outbox_sql import enqueue_on
from meshforge.publish.publisher import Publisher
from meshforge.store import open_store
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.connection import Connection


def own_subject() -> str:
    """A subject of this test alone: what another test's outbox sends never shows up here."""
    return f"cmd.default.shop{uuid.uuid4().hex[:8]}.inventory.reserve"


async def relay_all(url: str, conn: Connection, settings: Settings, subject: str) -> list[Envelope]:
    """Publish every due outbox row once, then read back what the stream holds."""
    store = open_store(url)
    try:
        relay = OutboxRelay(store, Publisher(conn.js, settings))
        while await relay.run_once():
            pass
        assert await relay.depth() == 0
    finally:
        store.close()
    found, seq = [], 1
    while True:
        try:
            raw = await conn.js.get_msg(STREAM_COMMANDS, seq=seq, subject=subject, next=True)
        except Exception:  # nothing at or after seq
            return found
        found.append(decode(raw.data or b"", raw.headers or {}))
        seq = (raw.seq or seq) + 1


@pytest.mark.postgres
async def test_psycopg_transaction_commits_the_message_with_the_row_or_neither(
    pg_database: str, meshforge_connection: Connection, meshforge_settings: Settings
) -> None:
    open_store(pg_database).close()  # creates the outbox table, as `meshforge relay` would
    subject = own_subject()
    kept = Envelope.new("inventory.reserve", {"order_id": "pg-1"})
    with psycopg.connect(pg_database) as db:
        db.execute("CREATE TABLE IF NOT EXISTS web_orders (order_id TEXT PRIMARY KEY)")
        with db.transaction(), db.cursor() as cur:
            cur.execute("INSERT INTO web_orders VALUES (%s)", ("pg-1",))
            enqueue_on(cur, subject, kept)
        with pytest.raises(psycopg.errors.UniqueViolation), db.transaction(), db.cursor() as cur:
            enqueue_on(cur, subject, Envelope.new("inventory.reserve", {"order_id": "pg-2"}))
            cur.execute("INSERT INTO web_orders VALUES (%s)", ("pg-1",))  # fails: rolls back both
    sent = await relay_all(pg_database, meshforge_connection, meshforge_settings, subject)
    assert [(e.id, e.payload) for e in sent] == [(kept.id, {"order_id": "pg-1"})]


async def test_sqlite3_transaction_commits_the_message_with_the_row_or_neither(
    tmp_path: Path, meshforge_connection: Connection, meshforge_settings: Settings
) -> None:
    url = f"sqlite:///{tmp_path / 'web.db'}"
    open_store(url).close()
    subject = own_subject()
    kept = Envelope.new("inventory.reserve", {"order_id": "s-1"})
    db = sqlite3.connect(tmp_path / "web.db")
    try:
        db.execute("CREATE TABLE web_orders (order_id TEXT PRIMARY KEY)")
        with db:  # one transaction
            db.execute("INSERT INTO web_orders VALUES (?)", ("s-1",))
            enqueue_on(db.cursor(), subject, kept, dialect="sqlite")
        with pytest.raises(sqlite3.IntegrityError), db:
            enqueue_on(db.cursor(), subject, Envelope.new("inventory.reserve", {"order_id": "s-2"}),
                       dialect="sqlite")  # fmt: skip
            db.execute("INSERT INTO web_orders VALUES (?)", ("s-1",))
    finally:
        db.close()
    sent = await relay_all(url, meshforge_connection, meshforge_settings, subject)
    assert [(e.id, e.payload) for e in sent] == [(kept.id, {"order_id": "s-1"})]
