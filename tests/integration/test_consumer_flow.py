"""Capacity, batches, push with a queue group, middleware order, timeouts and graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence

from consumer_support import (
    connection,
    counter_value,
    provision_all,
    publish_envelopes,
    running,
    settings,
    subject_for,
    unique_agent,
    wait_until,
)
from nats.js import JetStreamContext

from meshforge.consume.consumer import Consumer, Decision, Delivery, Handler
from meshforge.consume.middleware.tracing import SPAN_ID, TRACE_ID
from meshforge.envelope import Envelope
from meshforge.ops.observability import Metrics
from meshforge.topology.specs import agent_consumer
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.connection import Connection


@contextlib.asynccontextmanager
async def sampling_ack_pending(js: JetStreamContext, durable: str) -> AsyncIterator[list[int]]:
    """Sample the server's num_ack_pending for the consumer until the block ends."""
    samples: list[int] = []
    done = asyncio.Event()

    async def sample() -> None:
        # A flag, not cancellation: Python 3.11's wait_for (inside nats-py requests) can
        # swallow a cancel that races with the reply.
        while not done.is_set():
            info = await js.consumer_info(STREAM_COMMANDS, durable)
            samples.append(info.num_ack_pending or 0)
            await asyncio.sleep(0.02)  # sampling period

    task = asyncio.create_task(sample())
    try:
        yield samples
    finally:
        done.set()
        await asyncio.wait_for(task, 10)


async def test_concurrency_bound_and_no_fetch_beyond_capacity(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings(concurrency=3, batch_size=10)
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    running_now = 0
    peak = 0
    done: list[int] = []

    async def handle(d: Delivery) -> None:
        nonlocal running_now, peak
        running_now += 1
        peak = max(peak, running_now)
        await asyncio.sleep(0.05)  # simulated work
        running_now -= 1
        assert d.envelope is not None
        done.append(d.envelope.payload["n"])

    # ack_sync: an ack is processed by the server before the next fetch, so the server's
    # count of unacknowledged messages is exact (plain acks are applied asynchronously).
    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=metrics, ack_sync=True)
    await provision_all(js, s, spec)
    await publish_envelopes(js, subject_for(agent), 30)
    async with sampling_ack_pending(js, spec.durable) as samples, running(consumer):
        await wait_until(lambda: len(done) == 30, timeout=20)
    assert sorted(done) == list(range(30))
    assert peak == 3
    assert max(samples) <= 3, samples  # the server never handed out more than capacity
    assert len(samples) > 5
    info = await js.consumer_info(STREAM_COMMANDS, spec.durable)
    assert info.num_redelivered == 0 and info.num_ack_pending == 0
    assert counter_value(metrics.consumed, consumer=spec.durable) == 30


async def test_batch_handler_gets_one_fetch_at_a_time_and_is_kept_alive(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings(batch_size=4, ack_wait=1.0, backoff="1s")
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    batches: list[list[int]] = []

    async def handle_batch(ds: Sequence[Delivery]) -> list[Decision]:
        batches.append([d.envelope.payload["n"] for d in ds if d.envelope])
        if len(batches) == 1:
            await asyncio.sleep(2.5)  # longer than twice the ack wait: in_progress must cover it
        return [Decision.ack() for _ in ds]

    await provision_all(js, s, spec)
    await publish_envelopes(js, subject_for(agent), 10)
    await js.publish(subject_for(agent), b"not json")  # dead-lettered, never in a batch
    consumer = Consumer(
        conn, spec, batch_handler=handle_batch, settings=s, metrics=metrics, ack_sync=True
    )
    async with sampling_ack_pending(js, spec.durable) as samples, running(consumer):
        await wait_until(lambda: sum(map(len, batches)) == 10, timeout=20)
        await wait_until(lambda: counter_value(metrics.acked, consumer=spec.durable) == 11)
    assert sorted(n for b in batches for n in b) == list(range(10))
    assert all(1 <= len(b) <= 4 for b in batches)
    assert max(samples) <= 4
    info = await js.consumer_info(STREAM_COMMANDS, spec.durable)
    assert info.num_redelivered == 0
    assert counter_value(metrics.dead_lettered, consumer=spec.durable, reason="malformed") == 1


async def test_a_batch_consumer_takes_a_steady_trickle_in_few_batches(
    conn: Connection, js: JetStreamContext
) -> None:
    # Commands arrive one every 2 ms while each batch takes 30 ms: what comes meanwhile
    # waits at the server for the batch in flight and comes in one fetch, instead of a
    # fetch and a batch for each command or two.
    s = settings(batch_size=64)
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    batches: list[list[int]] = []

    async def handle_batch(ds: Sequence[Delivery]) -> list[Decision]:
        batches.append([d.envelope.payload["n"] for d in ds if d.envelope])
        await asyncio.sleep(0.03)  # the batch's work
        return [Decision.ack() for _ in ds]

    await provision_all(js, s, spec)
    consumer = Consumer(conn, spec, batch_handler=handle_batch, settings=s, metrics=metrics)
    async with running(consumer):
        started = time.monotonic()
        for env in [Envelope.new("test.do", {"n": i}) for i in range(100)]:
            await js.publish(subject_for(agent), env.encode(), headers=env.headers())
            await asyncio.sleep(0.002)  # the load's pace
        took = time.monotonic() - started
        await wait_until(lambda: counter_value(metrics.acked, consumer=spec.durable) == 100, timeout=20)
    assert sorted(n for b in batches for n in b) == list(range(100))
    # While a batch is in flight, one fetch every 10 ms at most (``_GATHER``), however slow
    # the publisher: a fetch for every command or two would be 50 batches or more.
    assert len(batches) <= min(60, took / 0.01 * 1.2 + 3), ([len(b) for b in batches], took)


async def test_batch_handler_error_applies_to_every_delivery(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings(batch_size=5, max_deliver=2, backoff="100ms")
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)

    async def handle_batch(ds: Sequence[Delivery]) -> list[Decision]:
        raise RuntimeError("downstream unavailable")

    await provision_all(js, s, spec)
    await publish_envelopes(js, subject_for(agent), 3)
    consumer = Consumer(conn, spec, batch_handler=handle_batch, settings=s, metrics=metrics)
    async with running(consumer):
        await wait_until(
            lambda: counter_value(
                metrics.dead_lettered, consumer=spec.durable, reason="max_deliveries"
            )
            == 3,
            timeout=15,
        )
    assert counter_value(metrics.naked, consumer=spec.durable) == 3


async def test_push_queue_group_handles_each_message_once(
    nats_url: str, js: JetStreamContext
) -> None:
    s = settings(concurrency=2)
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    await provision_all(js, s)
    seen: Counter[int] = Counter()
    by_member: Counter[str] = Counter()

    def handler(member: str) -> Handler:
        async def handle(d: Delivery) -> None:
            assert d.envelope is not None
            seen[d.envelope.payload["n"]] += 1
            by_member[member] += 1
            await asyncio.sleep(0.01)  # simulated work

        return handle

    async with connection(nats_url, "a") as ca, connection(nats_url, "b") as cb:
        first = Consumer(ca, spec, handler=handler("a"), settings=s, metrics=metrics, mode="push",
                         deliver_group="workers")  # fmt: skip
        second = Consumer(cb, spec, handler=handler("b"), settings=s, metrics=metrics, mode="push",
                          deliver_group="workers")  # fmt: skip
        async with running(first), running(second):
            info = await js.consumer_info(STREAM_COMMANDS, spec.durable)
            assert info.config.deliver_group == "workers"
            assert info.config.max_ack_pending == 2
            await publish_envelopes(js, subject_for(agent), 40)
            await wait_until(lambda: sum(seen.values()) >= 40, timeout=20)
            await wait_until(lambda: counter_value(metrics.acked, consumer=spec.durable) == 40)
    assert sorted(seen) == list(range(40))
    assert set(seen.values()) == {1}
    assert by_member["a"] > 0 and by_member["b"] > 0


async def test_middlewares_run_in_order_inside_tracing(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings()
    agent = unique_agent()
    spec = agent_consumer(agent, s)
    order: list[str] = []
    traces: list[tuple[str, str]] = []

    def named(name: str):  # type: ignore[no-untyped-def]
        async def mw(d: Delivery, call_next: Handler) -> Decision | None:
            order.append(f"{name}>")
            if name == "outer":
                traces.append((d.metadata[TRACE_ID], d.metadata[SPAN_ID]))
            result = await call_next(d)
            order.append(f"<{name}")
            return result

        return mw

    async def handle(d: Delivery) -> None:
        order.append("handler")

    consumer = Consumer(
        conn, spec, handler=handle, settings=s, metrics=Metrics(),
        middlewares=[named("outer"), named("inner")],
    )  # fmt: skip
    async with running(consumer):
        [env] = await publish_envelopes(js, subject_for(agent), 1)
        await wait_until(lambda: len(order) == 5)
    assert order == ["outer>", "inner>", "handler", "<inner", "<outer"]
    assert traces == [(env.trace_id, env.span_id)]


async def test_middleware_can_decide_without_the_handler(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings()
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    called: list[int] = []

    async def gate(d: Delivery, call_next: Handler) -> Decision | None:
        return Decision.dead_letter("rejected", "gate closed")

    async def handle(d: Delivery) -> None:
        called.append(1)

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=metrics, middlewares=[gate])
    async with running(consumer):
        await publish_envelopes(js, subject_for(agent), 1)
        await wait_until(
            lambda: counter_value(metrics.dead_lettered, consumer=spec.durable, reason="rejected")
            == 1
        )
    assert called == []


async def test_handler_timeout_is_transient(conn: Connection, js: JetStreamContext) -> None:
    s = settings(max_deliver=2, backoff="100ms")
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    calls: list[int] = []

    async def handle(d: Delivery) -> None:
        calls.append(d.num_delivered)
        await asyncio.sleep(10)  # never finishes within the timeout

    consumer = Consumer(
        conn, spec, handler=handle, settings=s, metrics=metrics, handler_timeout=0.2
    )
    async with running(consumer):
        await publish_envelopes(js, subject_for(agent), 1)
        await wait_until(
            lambda: counter_value(
                metrics.dead_lettered, consumer=spec.durable, reason="max_deliveries"
            )
            == 1
        )
    assert calls == [1, 2]


async def test_stop_finishes_in_flight_work_then_returns(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings(concurrency=4)
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    started: list[int] = []
    finished: list[int] = []

    async def handle(d: Delivery) -> None:
        started.append(1)
        await asyncio.sleep(0.5)  # in flight when stop() is called
        finished.append(1)

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=metrics)
    task = asyncio.create_task(consumer.run())
    await consumer.ready.wait()
    await publish_envelopes(js, subject_for(agent), 4)
    await wait_until(lambda: len(started) == 4)
    await consumer.stop(timeout=5)
    await asyncio.wait_for(task, 5)
    assert len(finished) == 4
    assert counter_value(metrics.acked, consumer=spec.durable) == 4
    assert counter_value(metrics.naked, consumer=spec.durable) == 0
    assert not consumer.ready.is_set()

    async def settled() -> bool:
        info = await js.consumer_info(STREAM_COMMANDS, spec.durable)
        return info.num_ack_pending == 0 and (info.num_pending or 0) == 0

    await wait_until(settled, timeout=5, what="the acks to be applied")


async def test_stop_naks_what_cannot_finish_so_it_comes_back_promptly(
    nats_url: str, js: JetStreamContext
) -> None:
    s = settings(concurrency=2, ack_wait=30)
    agent = unique_agent()
    spec = agent_consumer(agent, s)
    await provision_all(js, s)
    started: list[int] = []

    async def stuck(d: Delivery) -> None:
        started.append(d.num_delivered)
        await asyncio.sleep(60)  # cannot finish within the shutdown timeout

    second: list[int] = []

    async def quick(d: Delivery) -> None:
        second.append(d.num_delivered)

    async with connection(nats_url, "a") as ca, connection(nats_url, "b") as cb:
        first = Consumer(ca, spec, handler=stuck, settings=s, metrics=Metrics())
        task = asyncio.create_task(first.run())
        await first.ready.wait()
        await publish_envelopes(js, subject_for(agent), 2)
        await wait_until(lambda: len(started) == 2)
        t0 = time.monotonic()
        await first.stop(timeout=0.2)
        await asyncio.wait_for(task, 5)
        assert time.monotonic() - t0 < 3
        later = Consumer(cb, spec, handler=quick, settings=s, metrics=Metrics())
        async with running(later):
            # Well inside the 30 s ack wait: they were nak'ed, not abandoned.
            await wait_until(lambda: len(second) == 2, timeout=5)
    assert second == [2, 2]


async def test_idle_consumer_picks_up_a_new_message_quickly(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings()
    agent = unique_agent()
    spec = agent_consumer(agent, s)
    got: list[float] = []

    async def handle(d: Delivery) -> None:
        got.append(time.monotonic())

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=Metrics())
    async with running(consumer):
        await asyncio.sleep(2.5)  # let the consumer go idle (backoff at its cap)
        sent = time.monotonic()
        await publish_envelopes(js, subject_for(agent), 1)
        await wait_until(lambda: len(got) == 1, timeout=5)
    assert got[0] - sent < 1.5
