"""Conformance (see variants.py): flow for every variant: the server never hands out more
than the consumer can hold (back-pressure), members sharing a durable, an idle consumer
woken by a new message, graceful stop (in-flight work finished or nak'ed, nothing lost);
and what only batches do: one fetch per call, a trickle gathered into few batches, one
error for the whole batch. A batch handler in push mode is refused by design."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence

import pytest
from consumer_support import (
    connection,
    publish_envelopes,
    running,
    wait_until,
)
from nats.js import JetStreamContext
from variants import (
    BATCHES,
    DELIVER_GROUP,
    Case,
    Variant,
    ack_pending,
    each_variant,
    redelivered_and_pending,
    sampling_ack_pending,
    settled,
)

from meshforge.consume.consumer import Consumer, Decision, Delivery
from meshforge.envelope import Envelope
from meshforge.errors import ConfigError
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.connection import Connection


@each_variant()
async def test_the_server_never_hands_out_more_than_the_consumer_can_hold(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new(concurrency=3, batch_size=4)
    release = asyncio.Event()
    holding = peak = 0
    calls: list[int] = []
    done: list[int] = []

    async def behave(d: Delivery) -> None:
        nonlocal holding, peak
        holding += 1
        peak = max(peak, holding)
        await release.wait()
        holding -= 1
        assert d.envelope is not None
        done.append(d.envelope.payload["n"])

    # ack_sync: an ack is processed by the server before the next fetch, so the server's
    # count of unacknowledged messages is exact (plain acks are applied asynchronously).
    consumer = variant.consumer(conn, c, behave, ack_sync=True, calls=calls)
    # A single handler: the concurrency; a batch handler: two fetches (``max_held``).
    capacity = variant.capacity(consumer)
    assert capacity == (2 * 4 if variant.batch else 3)
    await publish_envelopes(js, c.subject, 30)  # a backlog before the consumer starts
    async with running(consumer), sampling_ack_pending(js, c.durable) as samples:
        await wait_until(lambda: holding == capacity, what=f"{capacity} deliveries held")
        # Held at capacity: nothing more is handed out, however long the handlers take.
        for _ in range(3):
            info = await js.consumer_info(STREAM_COMMANDS, c.durable)
            assert (info.num_ack_pending, info.num_pending) == (capacity, 30 - capacity)
            await asyncio.sleep(0.1)  # the handlers keep holding meanwhile
        assert holding == capacity
        if BATCHES in variant:
            assert calls == [4, 4]  # one fetch per call, the next fetched while one is held
        release.set()
        await wait_until(lambda: len(done) == 30, timeout=20)
    assert sorted(done) == list(range(30))
    assert peak == capacity
    assert len(samples) > 5 and max(samples) <= capacity, samples
    batch_size = 4 if BATCHES in variant else 1
    assert sum(calls) == 30 and all(1 <= n <= batch_size for n in calls), calls
    assert await redelivered_and_pending(js, c.durable) == (0, 0)
    assert c.count("consumed") == 30


@each_variant()
async def test_members_sharing_a_durable_each_take_a_share_and_every_message_once(
    variant: Variant, nats_url: str, js: JetStreamContext
) -> None:
    c = Case.new(concurrency=2, batch_size=2)
    seen: Counter[int] = Counter()
    by_member: Counter[str] = Counter()
    # A push durable delivers to one deliver group; a pull durable serves whoever pulls.
    options = {"deliver_group": "workers"} if DELIVER_GROUP in variant else {}

    def member(name: str):  # type: ignore[no-untyped-def]
        async def behave(d: Delivery) -> None:
            assert d.envelope is not None
            seen[d.envelope.payload["n"]] += 1
            by_member[name] += 1
            await asyncio.sleep(0.01)  # simulated work

        return behave

    async with connection(nats_url, "a") as ca, connection(nats_url, "b") as cb:
        first = variant.consumer(ca, c, member("a"), **options)
        second = variant.consumer(cb, c, member("b"), **options)
        async with running(first), running(second):
            if DELIVER_GROUP in variant:
                info = await js.consumer_info(STREAM_COMMANDS, c.durable)
                assert info.config.deliver_group == "workers"
                assert info.config.max_ack_pending == 2  # the concurrency, for the whole group
            await publish_envelopes(js, c.subject, 40)
            await wait_until(lambda: c.count("acked") == 40, 20)
    assert sorted(seen) == list(range(40))
    assert set(seen.values()) == {1}
    assert by_member["a"] > 0 and by_member["b"] > 0, by_member


@each_variant()
async def test_an_idle_consumer_picks_up_a_new_message_quickly(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new()
    got: list[float] = []

    async def behave(d: Delivery) -> None:
        got.append(time.monotonic())

    consumer = variant.consumer(conn, c, behave)
    async with running(consumer):
        await asyncio.sleep(2.5)  # let the consumer go idle (a pull loop's backoff at its cap)
        sent = time.monotonic()
        await publish_envelopes(js, c.subject, 1)
        await wait_until(lambda: len(got) == 1, timeout=10)
    # Quick is the feature: an idle pull loop waits at most 1 s between fetches
    # (OPERATIONS.md), 5x that for a loaded machine.
    assert got[0] - sent < 5 * 1.0


@each_variant()
async def test_stop_finishes_in_flight_work_then_returns(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new(concurrency=4)
    started: list[int] = []
    finished: list[int] = []

    async def behave(d: Delivery) -> None:
        started.append(1)
        await asyncio.sleep(0.5)  # in flight when stop() is called
        finished.append(1)

    consumer = variant.consumer(conn, c, behave)
    task = asyncio.create_task(consumer.run())
    await consumer.ready.wait()
    await publish_envelopes(js, c.subject, 4)
    await wait_until(lambda: len(started) == 4)
    await consumer.stop(timeout=5)
    await asyncio.wait_for(task, 5)
    assert len(finished) == 4
    assert c.count("acked") == 4
    assert c.count("naked") == 0
    assert not consumer.ready.is_set()
    await wait_until(lambda: settled(js, c.durable), timeout=5, what="the acks to be applied")


@each_variant()
async def test_stop_naks_what_cannot_finish_so_it_comes_back_promptly(
    variant: Variant, nats_url: str, js: JetStreamContext
) -> None:
    c = Case.new(concurrency=2, ack_wait=30)
    started: list[int] = []
    second: list[int] = []

    async def stuck(d: Delivery) -> None:
        started.append(d.num_delivered)
        await asyncio.sleep(60)  # cannot finish within the shutdown timeout

    async def quick(d: Delivery) -> None:
        second.append(d.num_delivered)

    async with connection(nats_url, "a") as ca, connection(nats_url, "b") as cb:
        first = variant.consumer(ca, c, stuck)
        task = asyncio.create_task(first.run())
        await first.ready.wait()
        await publish_envelopes(js, c.subject, 2)
        await wait_until(lambda: len(started) == 2)
        t0 = time.monotonic()
        await first.stop(timeout=0.2)
        await asyncio.wait_for(task, 5)
        # Not waiting for the 60 s handlers is the feature: 0.2 s, then up to two 1 s
        # heartbeats as the source closes, 5x that for a loaded machine.
        assert time.monotonic() - t0 < 5 * (0.2 + 2 * 1.0)
        later = variant.consumer(cb, c, quick)
        async with running(later):
            # Well inside the 30 s ack wait: they were nak'ed, not abandoned.
            await wait_until(lambda: len(second) == 2, timeout=10)
    assert second == [2, 2]
    assert await ack_pending(js, c.durable) == 0


@each_variant(BATCHES)
async def test_a_batch_consumer_takes_a_steady_trickle_in_few_batches(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    # Commands arrive one every 2 ms while each batch takes 30 ms: what comes meanwhile
    # waits at the server for the batch in flight and comes in one fetch, instead of a
    # fetch and a batch for each command or two.
    c = Case.new(batch_size=64)
    handled: list[int] = []
    calls: list[int] = []

    async def behave(d: Delivery) -> None:
        assert d.envelope is not None
        handled.append(d.envelope.payload["n"])
        await asyncio.sleep(0.03)  # the batch's work (its deliveries' at once)

    consumer = variant.consumer(conn, c, behave, calls=calls)
    async with running(consumer):
        started = time.monotonic()
        for env in [Envelope.new("test.do", {"n": i}) for i in range(100)]:
            await js.publish(c.subject, env.encode(), headers=env.headers())
            await asyncio.sleep(0.002)  # the load's pace
        took = time.monotonic() - started
        await wait_until(lambda: c.count("acked") == 100, 20)
    assert sorted(handled) == list(range(100))
    # While a batch is in flight, one fetch every 10 ms at most (``_GATHER``), however slow
    # the publisher; and at the intended pace (100 in under 0.5 s: a loaded machine may
    # publish slower than a batch takes, and then one at a time is right) fewer than 60:
    # a fetch for every command or two would be 50 batches or more.
    assert len(calls) <= took / 0.01 * 1.2 + 3, (calls, took)
    assert took >= 0.5 or len(calls) <= 60, (calls, took)


@each_variant(BATCHES)
async def test_a_batch_handler_error_decides_for_every_delivery_of_the_batch(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new(batch_size=5, max_deliver=2, backoff="1s")  # no redelivery but the naks'
    calls: list[int] = []

    async def handle_batch(ds: Sequence[Delivery]) -> list[Decision]:
        calls.append(len(ds))
        raise RuntimeError("downstream unavailable")

    await publish_envelopes(js, c.subject, 3)  # one fetch takes all three
    consumer = Consumer(
        conn, c.spec, batch_handler=handle_batch, settings=c.settings, metrics=c.metrics,
        mode=variant.mode,
    )  # fmt: skip
    async with running(consumer):
        await wait_until(
            lambda: c.count("dead_lettered", reason="max_deliveries") == 3,
            timeout=15,
        )
    assert calls[0] == 3 and sum(calls) == 6  # one error, three naks; then three dead letters
    assert c.count("naked") == 3


async def test_a_batch_handler_needs_pull(conn: Connection) -> None:
    """The matrix's fourth cell: a push consumer is handed one message at a time."""

    async def handle_batch(ds: Sequence[Delivery]) -> list[Decision]:
        return [Decision.ack() for _ in ds]

    c = Case.new()
    with pytest.raises(ConfigError, match="a batch handler needs mode='pull'"):
        Consumer(conn, c.spec, batch_handler=handle_batch, settings=c.settings, mode="push")
