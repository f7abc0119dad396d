"""Outbox against real stores and a real nats-server: transactions, order, leases, backoff."""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
from nats.js import JetStreamContext

from meshforge.config import Settings, load_settings
from meshforge.envelope import H_MSG_ID, Envelope
from meshforge.errors import InvalidSubject, StoreError
from meshforge.ops.observability import Metrics
from meshforge.publish.outbox import OutboxRelay, enqueue, enqueue_many
from meshforge.publish.publisher import Publisher
from meshforge.store import Store, open_store
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_EVENTS


def settings(**values: object) -> Settings:
    return load_settings(values, env={})


def count(metric: object, **labels: str) -> float:
    return float(metric.labels(**labels)._value.get())  # type: ignore[attr-defined]


async def read_ids(js: JetStreamContext, subject: str) -> list[str]:
    """The Nats-Msg-Id of every message stored on ``subject``, in stream order."""
    ids: list[str] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(STREAM_EVENTS, seq=seq, subject=subject, next=True)
        except Exception:  # no message at or after seq
            return ids
        assert msg.seq is not None
        ids.append((msg.headers or {}).get(H_MSG_ID, ""))
        seq = msg.seq + 1


async def stored(js: JetStreamContext, subject: str) -> int:
    info = await js.stream_info(STREAM_EVENTS, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def until(check: Callable[[], bool | Awaitable[bool]], within: float = 20.0) -> None:
    """Poll ``check`` (sync or async) until it is true; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)  # polling with a deadline


async def relay_until(
    relay: OutboxRelay, check: Callable[[], bool | Awaitable[bool]], within: float = 30.0
) -> None:
    """Run ``relay`` until ``check`` holds (polled, with a deadline), stop it, and check it
    ended without an error."""
    task = asyncio.create_task(relay.run())
    try:
        await until(check, within=within)
    finally:
        await relay.stop(timeout=10)
    assert task.done() and task.exception() is None


async def equals(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


def rows(store: Store) -> list[tuple[str, int, str | None]]:
    with store.transaction() as tx:
        return [
            (r[0], int(r[1]), r[2])
            for r in tx.execute("SELECT state, attempts, error FROM meshforge_outbox ORDER BY id")
        ]


@pytest.fixture
async def streams(js: JetStreamContext) -> JetStreamContext:
    await ensure(js, default_streams(settings()), [])
    return js


@pytest.fixture
async def subject(streams: JetStreamContext) -> AsyncIterator[str]:
    name = f"evt.default.outbox{uuid.uuid4().hex[:8]}.order.created"
    yield name
    await streams.purge_stream(STREAM_EVENTS, subject=name)


@pytest.fixture
def store(sqlite_url: str) -> Iterator[Store]:
    s = open_store(sqlite_url)
    yield s
    s.close()


def envs(n: int) -> list[Envelope]:
    return [Envelope.new("order.created", {"n": i}) for i in range(n)]


async def test_rows_of_a_transaction_are_published_in_order(
    streams: JetStreamContext, store: Store, subject: str
) -> None:
    batch = envs(250)
    with store.transaction() as tx:
        tx.execute("CREATE TABLE IF NOT EXISTS orders (n INTEGER)")
        for env in batch:
            tx.execute("INSERT INTO orders (n) VALUES (?)", (env.payload["n"],))
            enqueue(tx, subject, env)
    metrics = Metrics()
    relay = OutboxRelay(store, Publisher(streams, settings(), metrics), batch_size=100)
    assert await relay.depth() == 250
    assert [await relay.run_once() for _ in range(4)] == [100, 100, 50, 0]
    assert await read_ids(streams, subject) == [e.id for e in batch]
    assert await relay.depth() == 0
    assert metrics.outbox_depth._value.get() == 0  # type: ignore[attr-defined]
    assert {r[0] for r in rows(store)} == {"sent"}


async def test_rollback_publishes_nothing(
    streams: JetStreamContext, store: Store, subject: str
) -> None:
    with pytest.raises(RuntimeError), store.transaction() as tx:
        for env in envs(10):
            enqueue(tx, subject, env)
        raise RuntimeError("the caller's work failed")
    with pytest.raises(InvalidSubject), store.transaction() as tx:
        enqueue(tx, subject, envs(1)[0])
        enqueue(tx, "evt.bad.*", envs(1)[0])
    relay = OutboxRelay(store, Publisher(streams, settings(), Metrics()))
    assert await relay.run_once() == 0
    assert await relay.depth() == 0
    assert await stored(streams, subject) == 0


class WatchedRelay(OutboxRelay):
    """Records each idle pause as ``(seconds, ended early)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pauses: list[tuple[float, bool]] = []

    async def _idle(self, seconds: float) -> bool:
        woken = await super()._idle(seconds)
        self.pauses.append((seconds, woken))
        return woken


async def test_run_until_stop_wakes_on_notify(
    streams: JetStreamContext, store: Store, subject: str
) -> None:
    metrics = Metrics()
    relay = WatchedRelay(store, Publisher(streams, settings(), metrics), idle=30.0, batch_size=40)
    task = asyncio.create_task(relay.run())
    try:
        await until(lambda: relay.pause >= 0.8)  # idle, pausing longer each time
        batch = envs(100)
        with store.transaction() as tx:
            for env in batch:
                enqueue(tx, subject, env)
        pauses = len(relay.pauses)
        relay.notify()  # wakes the relay now rather than after its pause
        await until(lambda: equals(stored(streams, subject), 100), within=10)
        # The wake itself, not a time bound: a pause after the notify ended early.
        assert True in [woken for _, woken in relay.pauses[pauses:]], relay.pauses[pauses:]
        await until(lambda: metrics.outbox_depth._value.get() == 0)  # type: ignore[attr-defined]
    finally:
        await relay.stop(timeout=10)
    assert task.done() and task.exception() is None
    assert relay.sent_total == 100
    assert await read_ids(streams, subject) == [e.id for e in batch]


async def test_failures_back_off_then_succeed_or_give_up(
    streams: JetStreamContext, store: Store, subject: str
) -> None:
    nowhere = f"outboxtest{uuid.uuid4().hex[:6]}"
    late, big = envs(2)
    with store.transaction() as tx:
        enqueue(tx, f"{nowhere}.x", late)  # no stream yet: retried later
        tx.outbox_add(msg_id=big.id, subject=subject, data=b"x" * (1024 * 1024 + 1), headers={})
    metrics = Metrics()
    s = settings(publish_backoff_base=0.01, publish_backoff_cap=0.02)
    relay = OutboxRelay(store, Publisher(streams, s, metrics), retry_base=0.2, retry_cap=0.2)
    assert await relay.run_once() == 0
    (state1, attempts1, error1), (state2, attempts2, error2) = rows(store)
    assert (state1, attempts1) == ("failed", 1) and "meshforge provision" in (error1 or "")
    assert (state2, attempts2) == ("failed", 1) and "max_payload" in (error2 or "")
    assert await relay.depth() == 1  # the oversized row is given up, the other waits
    assert await relay.run_once() == 0  # not due yet: nothing claimed

    await streams.add_stream(name=nowhere.upper(), subjects=[f"{nowhere}.>"])
    try:
        await until(lambda: equals(relay.run_once(), 1), within=5)
        assert await relay.depth() == 0
        assert [r[0] for r in rows(store)] == ["sent", "failed"]
        assert count(metrics.publish_failures, kind="no_stream") == 1
    finally:
        await streams.delete_stream(nowhere.upper())


async def test_max_attempts_gives_up(streams: JetStreamContext, store: Store) -> None:
    with store.transaction() as tx:
        enqueue(tx, f"outboxnone{uuid.uuid4().hex[:6]}.x", envs(1)[0])
    s = settings(publish_backoff_base=0.001, publish_backoff_cap=0.001)
    relay = OutboxRelay(
        store, Publisher(streams, s, Metrics()), retry_base=0.01, retry_cap=0.01, max_attempts=2
    )
    await relay.run_once()
    await until(lambda: equals(_claim_then_depth(relay), 0), within=5)
    assert rows(store)[0][:2] == ("failed", 2)


async def _claim_then_depth(relay: OutboxRelay) -> int:
    await relay.run_once()
    return await relay.depth()


async def test_sent_rows_are_cleaned_after_retention(
    streams: JetStreamContext, store: Store, subject: str
) -> None:
    with store.transaction() as tx:
        for env in envs(5):
            enqueue(tx, subject, env)
    relay = OutboxRelay(store, Publisher(streams, settings(), Metrics()), retention=0.0)
    task = asyncio.create_task(relay.run())
    try:
        await until(lambda: rows(store) == [])
    finally:
        await relay.stop(timeout=10)
    assert await stored(streams, subject) == 5
    await task


@pytest.fixture
def pg_outbox_url(pg_database: str) -> Iterator[str]:
    """A database of this test alone: other tests' outbox rows must not reach this relay."""
    base, admin = pg_database.rsplit("/", 1)[0], pg_database
    name = f"meshforge_outbox_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"{base}/{name}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def test_two_relays_on_postgresql_send_each_row_once(
    streams: JetStreamContext, pg_outbox_url: str, subject: str
) -> None:
    total = 2000
    writer = open_store(pg_outbox_url)
    stores = [open_store(pg_outbox_url), open_store(pg_outbox_url)]
    try:
        batch = envs(total)
        for start in range(0, total, 500):
            with writer.transaction() as tx:
                for env in batch[start : start + 500]:
                    enqueue(tx, subject, env)
        metrics = [Metrics(), Metrics()]
        relays = [
            OutboxRelay(st, Publisher(streams, settings(), m), relay_id=f"relay-{i}", batch_size=50)
            for i, (st, m) in enumerate(zip(stores, metrics, strict=True))
        ]
        tasks = [asyncio.create_task(r.run()) for r in relays]
        try:
            await until(lambda: equals(relays[0].depth(), 0), within=60)
        finally:
            for relay in relays:
                await relay.stop(timeout=10)
        await asyncio.gather(*tasks)
        sent = [r.sent_total for r in relays]
        assert sum(sent) == total and min(sent) > 0, sent
        assert sum(count(m.publish_duplicates, stream=STREAM_EVENTS) for m in metrics) == 0
        ids = await read_ids(streams, subject)
        assert len(ids) == total and set(ids) == {e.id for e in batch}
    finally:
        for st in (writer, *stores):
            st.close()


async def test_run_claims_ahead_and_still_sends_each_row_once_in_order(
    streams: JetStreamContext, store: Store, subject: str
) -> None:
    batch = envs(1250)
    for start in range(0, len(batch), 250):
        with store.transaction() as tx:
            for env in batch[start : start + 250]:
                enqueue(tx, subject, env)
    metrics = Metrics()
    # Full batches of 200: each next batch is claimed while the one before publishes.
    relay = OutboxRelay(store, Publisher(streams, settings(), metrics), batch_size=200, idle=0.05)
    task = asyncio.create_task(relay.run())
    try:
        await until(lambda: equals(stored(streams, subject), len(batch)), within=30)
        await until(lambda: relay.sent_total == len(batch))
    finally:
        await relay.stop(timeout=10)
    assert task.done() and task.exception() is None
    assert await relay.depth() == 0
    assert await read_ids(streams, subject) == [e.id for e in batch]
    assert count(metrics.publish_duplicates, stream=STREAM_EVENTS) == 0


class CountingStore:
    """The store, counting the relay's outbox calls (a commit each)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.claims = 0
        self.marks = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    def outbox_claim(self, *args: object, **kwargs: object) -> object:
        self.claims += 1
        return self._store.outbox_claim(*args, **kwargs)  # type: ignore[arg-type]

    def outbox_mark_sent(self, ids: list[int]) -> None:
        self.marks += 1
        self._store.outbox_mark_sent(ids)


async def test_enqueue_many_rows_go_out_in_order_at_one_commit_a_batch(
    streams: JetStreamContext, store: Store, subject: str
) -> None:
    batch = envs(1000)
    with pytest.raises(InvalidSubject), store.transaction() as tx:
        enqueue_many(tx, [(subject, batch[0]), ("evt.bad subject", batch[1])])
    assert rows(store) == []  # nothing of a call with a bad subject is added
    for start in range(0, len(batch), 100):
        with store.transaction() as tx:
            ids = enqueue_many(tx, [(subject, env) for env in batch[start : start + 100]])
            assert ids == sorted(ids) and len(ids) == 100
    counting = CountingStore(store)
    relay = OutboxRelay(
        counting, Publisher(streams, settings(), Metrics()), batch_size=200, idle=0.05
    )  # type: ignore[arg-type]
    await relay_until(relay, lambda: relay.sent_total == len(batch))
    assert await read_ids(streams, subject) == [e.id for e in batch]
    assert await relay.depth() == 0
    # Five full batches: each claim after the first marks the batch before it sent, the
    # last one too (the claim that finds nothing more): no commit of its own per batch.
    assert counting.marks <= 2, (counting.claims, counting.marks)


class FlakyStore(CountingStore):
    """The store, with its second claim (one made ahead, during a publish) failing once."""

    def outbox_claim(self, *args: object, **kwargs: object) -> object:
        self.claims += 1
        if self.claims == 2:
            raise StoreError("sqlite store: database is locked", kind="busy", retriable=True)
        return self._store.outbox_claim(*args, **kwargs)  # type: ignore[arg-type]


async def test_a_failed_claim_made_ahead_is_tried_again(
    streams: JetStreamContext, store: Store, subject: str
) -> None:
    batch = envs(60)
    with store.transaction() as tx:
        enqueue_many(tx, [(subject, env) for env in batch])
    flaky = FlakyStore(store)
    relay = OutboxRelay(flaky, Publisher(streams, settings(), Metrics()), batch_size=20, idle=0.05)  # type: ignore[arg-type]
    await relay_until(relay, lambda: relay.sent_total == len(batch))
    assert flaky.claims < 20, flaky.claims  # the failed one was not awaited over and over
    assert await read_ids(streams, subject) == [e.id for e in batch]
    assert await relay.depth() == 0
