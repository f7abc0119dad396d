"""Conformance (see variants.py): what a handler's outcome does at the server, for every
variant: ack on success, a nak that comes back after its delay, in_progress for a slow
handler, term."""

from __future__ import annotations

import asyncio
import json
import time

from consumer_support import (
    dead_letters,
    histogram_count,
    publish_envelopes,
    running,
    wait_until,
)
from nats.js import JetStreamContext
from variants import Case, Variant, ack_pending, each_variant, redelivered_and_pending, settled

from meshforge.consume.consumer import Decision, Delivery
from meshforge.envelope import Envelope
from meshforge.errors import Retry
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.connection import Connection


@each_variant()
async def test_success_acks_and_counts(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new()
    seen: list[Delivery] = []

    async def behave(d: Delivery) -> None:
        seen.append(d)

    consumer = variant.consumer(conn, c, behave)
    async with running(consumer):
        [env] = await publish_envelopes(js, c.subject, 1)
        await wait_until(lambda: len(seen) == 1)
        # A body without ``ts`` gets the time the stream stored it.
        await js.publish(c.subject, json.dumps({"type": "test.do", "payload": {}}).encode())
        await wait_until(lambda: c.count("acked") == 2)
    first, second = seen
    assert first.envelope is not None and first.envelope.id == env.id
    assert (first.stream, first.num_delivered, first.subject) == (STREAM_COMMANDS, 1, c.subject)
    assert first.envelope.payload == {"n": 0}
    assert isinstance(second.envelope, Envelope) and second.envelope.ts == second.stored_ts
    assert await ack_pending(js, c.durable) == 0
    assert c.count("consumed") == 2
    assert c.count("redeliveries") == 0
    assert histogram_count(c.metrics.handler_seconds, consumer=c.durable) == 2
    assert histogram_count(c.metrics.end_to_end_seconds, consumer=c.durable) == 2
    assert c.count("in_flight") == 0


@each_variant()
async def test_a_nak_comes_back_after_its_delay_no_sooner_and_not_much_later(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    # One message nak'ed three ways: delivery 1 by a Decision, 2 by Retry(delay), 3 by an
    # error (the backoff schedule's third entry). The consumer has that schedule as its
    # server BackOff too, which adds BackOff[n-1] - AckWait to a delayed nak (the acker
    # sends that much less); the gaps the server leaves are what the handler asked for.
    c = Case.new(backoff="500ms,2s,2500ms")  # a lengthened nak would be 1.5 s and 2 s late
    wanted = (1.0, 1.75, 2.5)
    returned_at: list[float] = []
    arrivals: list[tuple[int, float]] = []

    async def behave(d: Delivery) -> Decision | None:
        arrivals.append((d.num_delivered, time.monotonic()))
        if d.num_delivered > len(wanted):
            return None
        returned_at.append(time.monotonic())
        if d.num_delivered == 1:
            return Decision.nak(wanted[0])
        if d.num_delivered == 2:
            raise Retry("busy", delay=wanted[1])
        raise RuntimeError("the backend is away")

    consumer = variant.consumer(conn, c, behave)
    async with running(consumer):
        await publish_envelopes(js, c.subject, 1)
        await wait_until(lambda: c.count("acked") == 1, timeout=15)
    assert [n for n, _ in arrivals] == [1, 2, 3, 4]
    gaps = [arrivals[i + 1][1] - returned_at[i] for i in range(len(wanted))]
    for gap, delay in zip(gaps, wanted, strict=True):
        # Never sooner; later only by the trip through the server and the event loop (tens of
        # milliseconds; 1 s leaves room for a stall), not by a lengthened nak (1.5 s or more late).
        assert delay <= gap <= delay + 1.0, ([round(g, 3) for g in gaps], wanted)
    assert c.count("naked") == 3
    assert c.count("redeliveries") == 3


@each_variant()
async def test_in_progress_keeps_a_slow_handler_past_the_ack_wait(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new(ack_wait=1.0, backoff="1s")
    assert c.spec.effective_ack_wait == 1.0
    deliveries: list[int] = []

    async def behave(d: Delivery) -> None:
        deliveries.append(d.num_delivered)
        await asyncio.sleep(2.5)  # the slow handler under test: 2.5 ack waits

    consumer = variant.consumer(conn, c, behave)
    async with running(consumer):
        # three slow handlers at once: one heartbeat task keeps all of them alive
        await publish_envelopes(js, c.subject, 3)
        await wait_until(lambda: c.count("acked") == 3, 15)
    assert deliveries == [1, 1, 1]
    assert await redelivered_and_pending(js, c.durable) == (0, 0)
    assert c.count("redeliveries") == 0


@each_variant()
async def test_term_stops_deliveries_without_a_dead_letter(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new(ack_wait=0.5, backoff="0.5s")
    deliveries: list[int] = []

    async def behave(d: Delivery) -> Decision:
        deliveries.append(d.num_delivered)
        return Decision.term()

    consumer = variant.consumer(conn, c, behave)
    async with running(consumer):
        await publish_envelopes(js, c.subject, 1)
        await wait_until(lambda: deliveries == [1])
        await wait_until(lambda: settled(js, c.durable), what="term to settle")
        await asyncio.sleep(1.5)  # window of three ack waits in which no redelivery may come
    assert deliveries == [1]
    assert await dead_letters(js, c.subject) == []
