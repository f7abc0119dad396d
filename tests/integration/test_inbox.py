"""The inbox on SQLite and PostgreSQL: one effect per (key, consumer), in the handler's transaction."""

from __future__ import annotations

from consumer_support import (
    counter_value,
    running,
    settings,
    subject_for,
    unique_agent,
    wait_until,
)
from inbox_support import TABLE, credit, credits, publish
from nats.js import JetStreamContext

from meshforge.consume.consumer import Consumer, Decision, Delivery
from meshforge.consume.inbox import AsyncTransaction, cleanup_inbox_once, inbox_cleanup, with_inbox
from meshforge.envelope import Envelope
from meshforge.errors import Unrecoverable
from meshforge.ops.observability import Metrics
from meshforge.store import Store, Transaction
from meshforge.topology.specs import agent_consumer
from meshforge.transport.connection import Connection


async def test_the_same_key_is_applied_once_per_consumer(
    conn: Connection, js: JetStreamContext, inbox_store: Store
) -> None:
    s = settings()
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    handler = with_inbox(inbox_store, spec.durable, credit, metrics=metrics)
    consumer = Consumer(conn, spec, handler=handler, settings=s, metrics=metrics)
    async with running(consumer):
        # Three requests, two of them the same request sent again (new id, same key).
        await publish(js, subject_for(agent), "k1", 10)
        await publish(js, subject_for(agent), "k1", 10)
        await publish(js, subject_for(agent), "k2", 5)
        await wait_until(lambda: counter_value(metrics.acked, consumer=spec.durable) == 3)
    assert credits(inbox_store) == [("k1", 10), ("k2", 5)]
    assert counter_value(metrics.duplicates_skipped, consumer=spec.durable) == 1
    rows = {r.key: r for r in inbox_store.inbox_read(spec.durable)}
    assert set(rows) == {"k1", "k2"}
    assert rows["k1"].status == "processed" and rows["k1"].processed_at is not None
    assert rows["k1"].subject == subject_for(agent) and rows["k1"].stream_seq
    assert rows["k1"].type == "test.credit" and rows["k1"].attempts == 1

    # Another consumer is another inbox: the same key is new to it.
    other = with_inbox(inbox_store, "other_consumer", lambda d, tx: None, metrics=metrics)
    [delivery] = [d for d in _fake_deliveries(rows["k1"].key)]
    assert await other(delivery) is None
    assert {r.key for r in inbox_store.inbox_read("other_consumer")} == {"k1"}


def _fake_deliveries(key: str) -> list[Delivery]:
    from datetime import UTC, datetime

    env = Envelope.new("test.credit", {"amount": 1}, idempotency_key=key)
    return [
        Delivery(
            msg=None,  # type: ignore[arg-type]  # the inbox never touches the message
            subject="cmd.default.test.x.do",
            data=env.encode(),
            headers=env.headers(),
            stream="MESHFORGE_COMMANDS",
            seq=1,
            num_delivered=1,
            timestamp=datetime.now(UTC),
            envelope=env,
        )
    ]


async def test_a_failing_handler_rolls_back_its_writes_and_records_the_failure(
    conn: Connection, js: JetStreamContext, inbox_store: Store
) -> None:
    s = settings(backoff="1s")  # the first ack wait: no second delivery but the nak's
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    attempts: list[int] = []

    def flaky(delivery: Delivery, tx: Transaction) -> None:
        attempts.append(delivery.num_delivered)
        credit(delivery, tx)  # written, then undone by the failure below
        if delivery.num_delivered == 1:
            raise RuntimeError("database of a partner is down")

    consumer = Consumer(
        conn, spec, handler=with_inbox(inbox_store, spec.durable, flaky, metrics=metrics),
        settings=s, metrics=metrics,
    )  # fmt: skip
    async with running(consumer):
        await publish(js, subject_for(agent), "flaky", 3)
        await wait_until(lambda: counter_value(metrics.acked, consumer=spec.durable) == 1)
    assert attempts == [1, 2]
    assert credits(inbox_store) == [("flaky", 3)]
    [row] = list(inbox_store.inbox_read(spec.durable))
    assert row.status == "processed" and row.attempts == 2  # the failed one was recorded
    assert row.failed_at is not None and row.deliveries == 2


def _status(store: Store, consumer: str, key: str) -> str | None:
    rows = [r for r in store.inbox_read(consumer) if r.key == key]
    return rows[0].status if rows else None


async def test_unrecoverable_errors_leave_a_failed_row_and_a_dead_letter(
    conn: Connection, js: JetStreamContext, inbox_store: Store
) -> None:
    s = settings()
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)

    def refuse(delivery: Delivery, tx: Transaction) -> None:
        credit(delivery, tx)
        raise Unrecoverable("amount out of range")

    consumer = Consumer(
        conn, spec, handler=with_inbox(inbox_store, spec.durable, refuse, metrics=metrics),
        settings=s, metrics=metrics,
    )  # fmt: skip
    async with running(consumer):
        await publish(js, subject_for(agent), "bad", 10**6)
        await wait_until(
            lambda: (
                counter_value(metrics.dead_lettered, consumer=spec.durable, reason="unrecoverable")
                == 1
            )
        )
    assert credits(inbox_store) == []
    [row] = list(inbox_store.inbox_read(spec.durable))
    assert row.status == "failed" and row.error is not None
    assert "amount out of range" in row.error


async def test_async_handlers_get_an_awaitable_transaction(
    conn: Connection, js: JetStreamContext, inbox_store: Store
) -> None:
    s = settings(concurrency=4)
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)

    async def credit_async(delivery: Delivery, tx: AsyncTransaction) -> Decision | None:
        assert delivery.envelope is not None
        key = delivery.envelope.key
        rows = await tx.execute(f"SELECT amount FROM {TABLE} WHERE key = ?", (key,))
        assert rows == []  # the inbox guarantees it is new
        await tx.execute(
            f"INSERT INTO {TABLE} (key, amount) VALUES (?, ?)",
            (key, delivery.envelope.payload["amount"]),
        )
        if delivery.envelope.payload["amount"] < 0:
            return Decision.dead_letter("rejected", "negative amount")  # rolls back
        return None

    consumer = Consumer(
        conn, spec, handler=with_inbox(inbox_store, spec.durable, credit_async, metrics=metrics),
        settings=s, metrics=metrics,
    )  # fmt: skip
    async with running(consumer):
        for i in range(6):
            await publish(js, subject_for(agent), f"a{i}", i)
        await publish(js, subject_for(agent), "a0", 0)  # the same request again
        await publish(js, subject_for(agent), "neg", -1)
        await wait_until(lambda: counter_value(metrics.acked, consumer=spec.durable) == 8)
    assert credits(inbox_store) == [(f"a{i}", i) for i in range(6)]
    assert counter_value(metrics.duplicates_skipped, consumer=spec.durable) == 1
    assert counter_value(metrics.dead_lettered, consumer=spec.durable, reason="rejected") == 1
    assert _status(inbox_store, spec.durable, "neg") == "failed"


async def test_cleanup_removes_finished_rows_past_retention(inbox_store: Store) -> None:
    handler = with_inbox(inbox_store, "c", lambda d, tx: None, metrics=Metrics())
    for key in ("old1", "old2"):
        [delivery] = _fake_deliveries(key)
        await handler(delivery)
    with inbox_store.transaction() as tx:  # one still being worked on: never removed
        tx.inbox_begin("busy", "c", message_id=None, type=None, subject=None, stream=None,
                       stream_seq=None, deliveries=1, headers={})  # fmt: skip
    assert await cleanup_inbox_once(inbox_store, retention=3600) == 0  # all recent
    assert await cleanup_inbox_once(inbox_store, retention=0) == 2
    assert [r.key for r in inbox_store.inbox_read("c")] == ["busy"]

    import asyncio

    stop = asyncio.Event()
    [delivery] = _fake_deliveries("old3")
    await handler(delivery)
    task = asyncio.create_task(inbox_cleanup(inbox_store, 0, interval=0.05, stop=stop))
    await wait_until(lambda: [r.key for r in inbox_store.inbox_read("c")] == ["busy"])
    stop.set()
    await asyncio.wait_for(task, 5)
