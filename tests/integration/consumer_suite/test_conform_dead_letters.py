"""Conformance (see variants.py): dead letters for every variant: the reason of each error
class with the CONTRACT headers and the original message, malformed input refused at the
door, the delivery limit, and a dead letter that cannot be published."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from consumer_support import (
    dead_letters,
    provision_all,
    publish_envelopes,
    running,
    settings,
    wait_until,
)
from nats.js import JetStreamContext
from variants import Case, Variant, ack_pending, assert_contract_headers, each_variant

from meshforge.consume.consumer import Decision, Delivery
from meshforge.deadletters.route import H_DLQ_ERROR, H_DLQ_REASON, H_DLQ_STREAM_SEQ
from meshforge.envelope import H_MSG_ID
from meshforge.errors import Expired, Rejected, Unrecoverable
from meshforge.ops.observability import Metrics
from meshforge.topology.subjects import STREAM_FAILED
from meshforge.transport.connection import Connection


class DomainError(Exception):
    pass


# The error each message's handler raises (by payload ``n``), and the reason it lands with.
POISON: list[tuple[Exception, str]] = [
    (Unrecoverable("bad order"), "unrecoverable"),
    (DomainError("configured as unrecoverable"), "unrecoverable"),
    (Rejected("epoch mismatch"), "rejected"),
    (Expired("deadline passed"), "expired"),
]


@each_variant()
async def test_each_error_class_lands_with_its_reason_and_the_original_message(
    variant: Variant, conn: Connection, js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    # One delivery per fetch, so that a batch handler's error is that message's alone.
    c = Case.new(batch_size=1)
    calls: list[tuple[int, int]] = []

    async def behave(d: Delivery) -> None:
        assert d.envelope is not None
        calls.append((d.envelope.payload["n"], d.num_delivered))
        raise POISON[d.envelope.payload["n"]][0]

    consumer = variant.consumer(conn, c, behave, unrecoverable=(DomainError,))
    subject = c.subject
    async with running(consumer):
        envs = await publish_envelopes(js, subject, len(POISON))
        await wait_until(lambda: c.count("acked") == len(POISON))
    assert sorted(calls) == [(n, 1) for n in range(len(POISON))]
    for reason in {r for _, r in POISON}:
        wanted = sum(r == reason for _, r in POISON)
        assert c.count("dead_lettered", reason=reason) == wanted
    letters = {letter.headers[H_MSG_ID]: letter for letter in await dead_letters(js, subject)}  # type: ignore[index]
    assert set(letters) == {env.id for env in envs}  # original headers untouched
    logged = {
        r.stream_seq: r.levelno  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "meshforge.consumer" and r.getMessage().startswith("dead-lettered")
    }
    for env, (error, reason) in zip(envs, POISON, strict=True):
        letter = letters[env.id]
        assert_contract_headers(
            letter, reason=reason, subject=subject, durable=c.durable, deliveries=1
        )
        assert letter.headers is not None
        assert letter.headers[H_DLQ_ERROR] == f"{type(error).__name__}: {error}"
        assert letter.data == env.encode()
        # A command that will never be applied is CRITICAL (seed 000); one refused at the
        # door is not.
        seq = int(letter.headers[H_DLQ_STREAM_SEQ])
        assert logged[seq] == (logging.WARNING if reason == "rejected" else logging.CRITICAL)


@each_variant()
async def test_malformed_input_is_dead_lettered_once_and_never_reaches_the_handler(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new()
    handled: list[int] = []

    async def behave(d: Delivery) -> None:
        assert d.envelope is not None
        handled.append(d.envelope.payload["n"])

    consumer = variant.consumer(conn, c, behave)
    subject = c.subject
    async with running(consumer):
        # (its own message id: the stream drops a repeated one as a duplicate)
        await js.publish(
            subject, b"{not json", headers={H_MSG_ID: f"bad-{c.agent}", "X-Custom": "kept"}
        )
        await js.publish(subject, json.dumps({"type": "x"}).encode())  # lacks payload
        await publish_envelopes(js, subject, 1)  # a good one among them
        await wait_until(lambda: c.count("acked") == 3)
    assert handled == [0]
    assert c.count("dead_lettered", reason="malformed") == 2
    letters = await dead_letters(js, subject)
    assert len(letters) == 2
    for letter in letters:
        assert_contract_headers(
            letter, reason="malformed", subject=subject, durable=c.durable, deliveries=1
        )
    assert letters[0].data == b"{not json"
    assert letters[0].headers is not None and letters[0].headers["X-Custom"] == "kept"
    assert "payload" in letters[1].headers[H_DLQ_ERROR]  # type: ignore[index]
    assert await ack_pending(js, c.durable) == 0


@each_variant()
async def test_exhausted_deliveries_give_exactly_one_dead_letter(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new(max_deliver=3, backoff="1s,300ms,300ms", ack_wait=1.0)  # a first ack wait of 1 s
    assert c.spec.max_deliver == -1  # attempts are counted by the consumer: settings.max_deliver
    calls: list[int] = []

    async def behave(d: Delivery) -> None:
        calls.append(d.num_delivered)
        raise ValueError(f"attempt {d.num_delivered} failed")

    consumer = variant.consumer(conn, c, behave)
    subject = c.subject
    async with running(consumer):
        await publish_envelopes(js, subject, 1)
        await wait_until(lambda: c.count("dead_lettered", reason="max_deliveries") == 1)
        await asyncio.sleep(1.5)  # the point: nothing more comes in five of the 300 ms ack waits
    assert calls == [1, 2, 3]
    [letter] = await dead_letters(js, subject)
    assert_contract_headers(
        letter, reason="max_deliveries", subject=subject, durable=c.durable, deliveries=3
    )
    assert letter.headers is not None and "attempt 3 failed" in letter.headers[H_DLQ_ERROR]
    assert c.count("deliveries_exhausted") == 1
    assert c.count("naked") == 2
    assert await ack_pending(js, c.durable) == 0


@each_variant()
async def test_a_delivery_beyond_the_limit_is_dead_lettered_without_the_handler(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new(max_deliver=2, backoff="1s")  # the ack wait: longer than the stop takes
    subject = c.subject
    before: list[int] = []
    stuck = asyncio.Event()  # never set: the second delivery never finishes

    async def fail_then_hang(d: Delivery) -> Decision | None:
        before.append(d.num_delivered)
        if d.num_delivered == 1:
            return Decision.nak(0)
        await stuck.wait()
        return None

    # Another member had the message twice: it nak'ed the first delivery and was stopped
    # during the second, which its stop nak'ed.
    first = variant.consumer(conn, c, fail_then_hang, metrics=Metrics())
    async with running(first):
        await publish_envelopes(js, subject, 1)
        await wait_until(lambda: before == [1, 2])
        await first.stop(timeout=0.1)
    calls: list[int] = []

    async def behave(d: Delivery) -> None:
        calls.append(d.num_delivered)

    consumer = variant.consumer(conn, c, behave)
    async with running(consumer):
        await wait_until(lambda: c.count("dead_lettered", reason="max_deliveries") == 1)
    assert calls == []
    [letter] = await dead_letters(js, subject)
    assert_contract_headers(
        letter, reason="max_deliveries", subject=subject, durable=c.durable, deliveries=3
    )


@each_variant()
async def test_a_dead_letter_that_cannot_be_published_naks_instead_of_acking(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new(publish_attempts=1, publish_timeout=0.5)
    await js.delete_stream(STREAM_FAILED)
    subject = c.subject

    async def behave(d: Delivery) -> None:
        raise Unrecoverable("poison")

    consumer = variant.consumer(conn, c, behave)
    try:
        async with running(consumer):
            await publish_envelopes(js, subject, 1)
            await wait_until(lambda: c.count("naked") >= 1)
            assert c.count("acked") == 0
            assert await ack_pending(js, c.durable) == 1  # kept, not acked
            await provision_all(js, settings())  # the dead-letter stream is back
            await wait_until(lambda: c.count("dead_lettered", reason="unrecoverable") == 1, 15)
    finally:
        await provision_all(js, settings())
    [letter] = await dead_letters(js, subject)
    assert letter.headers is not None and letter.headers[H_DLQ_REASON] == "unrecoverable"
    assert c.count("acked") == 1


@each_variant()
async def test_a_handler_that_runs_past_its_timeout_is_retried_then_dead_lettered(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new(max_deliver=2, backoff="1s")  # the ack wait: far past the 0.2 s timeout
    calls: list[int] = []

    async def behave(d: Delivery) -> None:
        calls.append(d.num_delivered)
        await asyncio.sleep(10)  # never finishes within the timeout

    consumer = variant.consumer(conn, c, behave, handler_timeout=0.2)
    async with running(consumer):
        await publish_envelopes(js, c.subject, 1)
        await wait_until(lambda: c.count("dead_lettered", reason="max_deliveries") == 1)
    assert calls == [1, 2]
    assert c.count("naked") == 1
