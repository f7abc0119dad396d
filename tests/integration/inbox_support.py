"""Helpers for the inbox tests: a table the handlers credit, and requests to credit it."""

from __future__ import annotations

from nats.js import JetStreamContext

from meshforge.consume.decisions import Delivery
from meshforge.envelope import Envelope
from meshforge.store import Store, Transaction

TABLE = "credits"


def create_credits(store: Store) -> None:
    with store.transaction() as tx:
        tx.execute(f"CREATE TABLE {TABLE} (key TEXT PRIMARY KEY, amount INTEGER NOT NULL)")


def credits(store: Store) -> list[tuple[str, int]]:
    with store.transaction() as tx:
        return [
            (r[0], int(r[1])) for r in tx.execute(f"SELECT key, amount FROM {TABLE} ORDER BY key")
        ]


def credit(delivery: Delivery, tx: Transaction) -> None:
    assert delivery.envelope is not None
    tx.execute(
        f"INSERT INTO {TABLE} (key, amount) VALUES (?, ?)",
        (delivery.envelope.key, delivery.envelope.payload["amount"]),
    )


async def publish(js: JetStreamContext, subject: str, key: str, amount: int) -> Envelope:
    env = Envelope.new("test.credit", {"amount": amount}, idempotency_key=key)
    await js.publish(subject, env.encode(), headers=env.headers())
    return env
