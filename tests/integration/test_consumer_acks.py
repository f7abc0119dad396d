"""Every ack path against a real nats-server: ack, nak(delay), in_progress, term, dead letters."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from consumer_support import (
    counter_value,
    dead_letters,
    histogram_count,
    provision_all,
    publish_envelopes,
    running,
    settings,
    subject_for,
    unique_agent,
    wait_until,
)
from nats.js import JetStreamContext

from meshforge.consume.consumer import Consumer, Decision, Delivery
from meshforge.deadletters.route import (
    H_DLQ_CONSUMER,
    H_DLQ_DELIVERIES,
    H_DLQ_ERROR,
    H_DLQ_ORIGINAL_SUBJECT,
    H_DLQ_REASON,
    H_DLQ_STREAM,
    H_DLQ_STREAM_SEQ,
    H_DLQ_TIMESTAMP,
)
from meshforge.envelope import H_MSG_ID, Envelope
from meshforge.errors import Expired, Rejected, Retry, Unrecoverable
from meshforge.ops.observability import Metrics
from meshforge.topology.specs import agent_consumer
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.connection import Connection


async def ack_pending(js: JetStreamContext, durable: str) -> int:
    return (await js.consumer_info(STREAM_COMMANDS, durable)).num_ack_pending or 0


async def test_success_acks_and_counts(conn: Connection, js: JetStreamContext) -> None:
    s = settings()
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    seen: list[Delivery] = []

    async def handle(d: Delivery) -> None:
        seen.append(d)

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=metrics)
    async with running(consumer):
        [env] = await publish_envelopes(js, subject_for(agent), 1)
        await wait_until(lambda: counter_value(metrics.acked, consumer=spec.durable) == 1)
    assert [d.envelope.id for d in seen if d.envelope] == [env.id]
    d = seen[0]
    assert (d.stream, d.num_delivered, d.subject) == (STREAM_COMMANDS, 1, subject_for(agent))
    assert d.envelope is not None and d.envelope.payload == {"n": 0}
    assert await ack_pending(js, spec.durable) == 0
    label = {"consumer": spec.durable}
    assert counter_value(metrics.consumed, **label) == 1
    assert counter_value(metrics.redeliveries, **label) == 0
    assert histogram_count(metrics.handler_seconds, **label) == 1
    assert histogram_count(metrics.end_to_end_seconds, **label) == 1
    assert counter_value(metrics.in_flight, **label) == 0


@pytest.mark.parametrize("how", ["decision", "retry"])
async def test_nak_with_delay_comes_back_no_sooner(
    conn: Connection, js: JetStreamContext, how: str
) -> None:
    s = settings()
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    delay = 1.2
    returned_at: list[float] = []
    arrivals: list[tuple[int, float]] = []

    async def handle(d: Delivery) -> Decision | None:
        arrivals.append((d.num_delivered, time.monotonic()))
        if d.num_delivered == 1:
            returned_at.append(time.monotonic())
            if how == "retry":
                raise Retry("busy", delay=delay)
            return Decision.nak(delay)
        return None

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=metrics)
    async with running(consumer):
        await publish_envelopes(js, subject_for(agent), 1)
        await wait_until(lambda: len(arrivals) == 2, timeout=10)
        await wait_until(lambda: counter_value(metrics.acked, consumer=spec.durable) == 1)
    assert [n for n, _ in arrivals] == [1, 2]
    assert arrivals[1][1] - returned_at[0] >= delay
    assert counter_value(metrics.naked, consumer=spec.durable) == 1
    assert counter_value(metrics.redeliveries, consumer=spec.durable) == 1


async def test_in_progress_keeps_a_long_handler_from_redelivery(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings(ack_wait=1.0, backoff="1s")
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    assert spec.effective_ack_wait == 1.0
    deliveries: list[int] = []

    async def handle(d: Delivery) -> None:
        deliveries.append(d.num_delivered)
        await asyncio.sleep(3.0)  # the long handler under test: 3x the ack wait

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=metrics)
    async with running(consumer):
        # three long handlers at once: one heartbeat task keeps all of them alive
        await publish_envelopes(js, subject_for(agent), 3)
        await wait_until(lambda: counter_value(metrics.acked, consumer=spec.durable) == 3, 10)
    assert deliveries == [1, 1, 1]
    info = await js.consumer_info(STREAM_COMMANDS, spec.durable)
    assert info.num_redelivered == 0 and info.num_ack_pending == 0
    assert counter_value(metrics.redeliveries, consumer=spec.durable) == 0


async def test_term_stops_deliveries_without_a_dead_letter(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings(ack_wait=0.5, backoff="0.5s")
    agent = unique_agent()
    spec = agent_consumer(agent, s)
    deliveries: list[int] = []

    async def handle(d: Delivery) -> Decision:
        deliveries.append(d.num_delivered)
        return Decision.term()

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=Metrics())
    async with running(consumer):
        await publish_envelopes(js, subject_for(agent), 1)
        await wait_until(lambda: deliveries == [1])
        await wait_until(lambda: _ack_floor_moved(js, spec.durable), what="term to settle")
        await asyncio.sleep(1.5)  # window of three ack waits in which no redelivery may come
    assert deliveries == [1]
    assert await dead_letters(js, subject_for(agent)) == []


async def _ack_floor_moved(js: JetStreamContext, durable: str) -> bool:
    info = await js.consumer_info(STREAM_COMMANDS, durable)
    return info.num_ack_pending == 0 and info.ack_floor is not None and (info.ack_floor.stream_seq or 0) > 0


def assert_contract_headers(
    msg: object, *, reason: str, subject: str, durable: str, deliveries: int
) -> None:
    headers = msg.headers or {}  # type: ignore[attr-defined]
    assert headers[H_DLQ_REASON] == reason
    assert headers[H_DLQ_ORIGINAL_SUBJECT] == subject
    assert headers[H_DLQ_STREAM] == STREAM_COMMANDS
    assert int(headers[H_DLQ_STREAM_SEQ]) > 0
    assert headers[H_DLQ_CONSUMER] == durable
    assert headers[H_DLQ_DELIVERIES] == str(deliveries)
    assert headers[H_DLQ_TIMESTAMP].endswith("Z")
    assert "\n" not in headers[H_DLQ_ERROR] and len(headers[H_DLQ_ERROR].encode()) <= 1024


async def test_malformed_body_is_dead_lettered_once_and_never_reaches_the_handler(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings()
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    called: list[Delivery] = []

    async def handle(d: Delivery) -> None:
        called.append(d)

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=metrics)
    subject = subject_for(agent)
    async with running(consumer):
        await js.publish(subject, b"{not json", headers={H_MSG_ID: "bad-1", "X-Custom": "kept"})
        await js.publish(subject, json.dumps({"type": "x"}).encode())  # lacks payload
        await wait_until(
            lambda: counter_value(metrics.dead_lettered, consumer=spec.durable, reason="malformed")
            == 2
        )
    assert called == []
    letters = await dead_letters(js, subject)
    assert len(letters) == 2
    for letter in letters:
        assert_contract_headers(
            letter, reason="malformed", subject=subject, durable=spec.durable, deliveries=1
        )
    assert letters[0].data == b"{not json"
    assert letters[0].headers is not None and letters[0].headers["X-Custom"] == "kept"
    assert "payload" in letters[1].headers[H_DLQ_ERROR]  # type: ignore[index]
    assert await ack_pending(js, spec.durable) == 0
    assert counter_value(metrics.acked, consumer=spec.durable) == 2


class DomainError(Exception):
    pass


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (Unrecoverable("bad order"), "unrecoverable"),
        (DomainError("configured as unrecoverable"), "unrecoverable"),
        (Rejected("epoch mismatch"), "rejected"),
        (Expired("deadline passed"), "expired"),
    ],
)
async def test_poison_classes_land_with_their_reason(
    conn: Connection, js: JetStreamContext, error: Exception, reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    s = settings()
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    calls: list[int] = []

    async def handle(d: Delivery) -> None:
        calls.append(d.num_delivered)
        raise error

    consumer = Consumer(
        conn, spec, handler=handle, settings=s, metrics=metrics, unrecoverable=(DomainError,)
    )
    subject = subject_for(agent)
    async with running(consumer):
        [env] = await publish_envelopes(js, subject, 1)
        await wait_until(
            lambda: counter_value(metrics.dead_lettered, consumer=spec.durable, reason=reason) == 1
        )
        await wait_until(lambda: counter_value(metrics.acked, consumer=spec.durable) == 1)
    assert calls == [1]
    [letter] = await dead_letters(js, subject)
    assert_contract_headers(letter, reason=reason, subject=subject, durable=spec.durable, deliveries=1)
    assert letter.headers is not None
    assert letter.headers[H_DLQ_ERROR] == f"{type(error).__name__}: {error}"
    assert letter.headers[H_MSG_ID] == env.id  # original headers untouched
    assert letter.data == env.encode()
    # A command that will never be applied is CRITICAL (seed 000); one refused at the door is not.
    [logged] = [r for r in caplog.records if r.name == "meshforge.consumer" and r.getMessage().startswith("dead-lettered")]
    assert logged.levelno == (logging.WARNING if reason == "rejected" else logging.CRITICAL)


async def test_max_deliver_exhaustion_gives_exactly_one_dead_letter(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings(max_deliver=3, backoff="100ms,100ms,100ms", ack_wait=1.0)
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    assert spec.max_deliver == -1  # attempts are counted by the consumer: settings.max_deliver
    calls: list[int] = []

    async def handle(d: Delivery) -> None:
        calls.append(d.num_delivered)
        raise ValueError(f"attempt {d.num_delivered} failed")

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=metrics)
    subject = subject_for(agent)
    label = {"consumer": spec.durable}
    async with running(consumer):
        await publish_envelopes(js, subject, 1)
        await wait_until(
            lambda: counter_value(metrics.dead_lettered, reason="max_deliveries", **label) == 1
        )
        await asyncio.sleep(1.5)  # longer than any backoff or ack wait: nothing more may come
    assert calls == [1, 2, 3]
    [letter] = await dead_letters(js, subject)
    assert_contract_headers(
        letter, reason="max_deliveries", subject=subject, durable=spec.durable, deliveries=3
    )
    assert letter.headers is not None and "attempt 3 failed" in letter.headers[H_DLQ_ERROR]
    assert counter_value(metrics.deliveries_exhausted, **label) == 1
    assert counter_value(metrics.naked, **label) == 2
    assert await ack_pending(js, spec.durable) == 0


async def test_a_delivery_beyond_the_limit_is_dead_lettered_without_the_handler(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings(max_deliver=2, backoff="100ms")
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    await provision_all(js, s, spec)
    subject = subject_for(agent)
    await publish_envelopes(js, subject, 1)
    # Another worker took the message twice and died each time (nak stands for that).
    raw = await js.pull_subscribe_bind(spec.durable, STREAM_COMMANDS)
    for _ in range(2):
        [msg] = await raw.fetch(1, timeout=5)
        await msg.nak()
    await raw.unsubscribe()
    calls: list[int] = []

    async def handle(d: Delivery) -> None:
        calls.append(d.num_delivered)

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=metrics)
    async with running(consumer):
        await wait_until(
            lambda: counter_value(
                metrics.dead_lettered, consumer=spec.durable, reason="max_deliveries"
            )
            == 1
        )
    assert calls == []
    [letter] = await dead_letters(js, subject)
    assert_contract_headers(
        letter, reason="max_deliveries", subject=subject, durable=spec.durable, deliveries=3
    )


async def test_a_failed_dead_letter_publish_naks_instead_of_acking(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings(publish_attempts=1, publish_timeout=0.5)
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    await js.delete_stream("MESHFORGE_FAILED")
    subject = subject_for(agent)

    async def handle(d: Delivery) -> None:
        raise Unrecoverable("poison")

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=metrics)
    label = {"consumer": spec.durable}
    try:
        async with running(consumer):
            await publish_envelopes(js, subject, 1)
            await wait_until(lambda: counter_value(metrics.naked, **label) >= 1)
            assert counter_value(metrics.acked, **label) == 0
            assert await ack_pending(js, spec.durable) == 1  # kept, not acked
            await provision_all(js, settings())  # the dead-letter stream is back
            await wait_until(
                lambda: counter_value(metrics.dead_lettered, reason="unrecoverable", **label) == 1,
                timeout=15,
            )
    finally:
        await provision_all(js, settings())
    assert len(await dead_letters(js, subject)) == 1
    assert counter_value(metrics.acked, **label) == 1


async def test_decode_false_hands_raw_bytes_and_headers(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings()
    agent = unique_agent()
    spec = agent_consumer(agent, s)
    seen: list[Delivery] = []

    async def handle(d: Delivery) -> None:
        seen.append(d)

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=Metrics(), decode=False)
    async with running(consumer):
        await js.publish(subject_for(agent), b"raw bytes", headers={"Idempotency-Key": "k1"})
        await wait_until(lambda: len(seen) == 1)
    assert seen[0].envelope is None and seen[0].data == b"raw bytes"
    assert seen[0].key == "k1"
    assert isinstance(seen[0].timestamp.tzinfo, type(seen[0].timestamp.tzinfo))


async def test_envelope_ts_defaults_to_the_stored_time(
    conn: Connection, js: JetStreamContext
) -> None:
    s = settings()
    agent = unique_agent()
    spec = agent_consumer(agent, s)
    seen: list[Delivery] = []

    async def handle(d: Delivery) -> None:
        seen.append(d)

    consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=Metrics())
    async with running(consumer):
        body = {"type": "test.do", "payload": {}}
        await js.publish(subject_for(agent), json.dumps(body).encode())
        await wait_until(lambda: len(seen) == 1)
    env = seen[0].envelope
    assert isinstance(env, Envelope)
    assert env.ts == seen[0].stored_ts
