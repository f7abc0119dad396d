"""Conformance (see variants.py): around the handler, for every variant: middlewares and
their order (a handler of one delivery only, by design), raw bytes without decoding, and
the inbox turning a redelivered message into a duplicate."""

from __future__ import annotations

from datetime import timedelta

import pytest
from consumer_support import (
    publish_envelopes,
    running,
    wait_until,
)
from inbox_support import credit, credits, publish
from nats.js import JetStreamContext
from variants import MIDDLEWARES, Case, Variant, each_variant

from meshforge.consume.consumer import Consumer, Decision, Delivery, Handler
from meshforge.consume.inbox import with_inbox
from meshforge.consume.middleware.tracing import SPAN_ID, TRACE_ID
from meshforge.errors import ConfigError
from meshforge.store import Store, Transaction
from meshforge.transport.connection import Connection


@each_variant()
async def test_middlewares_run_in_order_inside_tracing(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new()
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

    async def behave(d: Delivery) -> None:
        order.append("handler")

    middlewares = [named("outer"), named("inner")]
    if MIDDLEWARES not in variant:
        # A batch handler is one call for a whole fetch: middlewares of one delivery would
        # not run, and the consumer says so rather than drop them.
        with pytest.raises(ConfigError, match="a batch handler runs without them"):
            variant.consumer(conn, c, behave, middlewares=middlewares)
        return
    consumer = variant.consumer(conn, c, behave, middlewares=middlewares)
    async with running(consumer):
        [env] = await publish_envelopes(js, c.subject, 1)
        await wait_until(lambda: len(order) == 5)
    assert order == ["outer>", "inner>", "handler", "<inner", "<outer"]
    assert traces == [(env.trace_id, env.span_id)]


@each_variant(MIDDLEWARES)
async def test_a_middleware_can_decide_without_the_handler(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new()
    called: list[int] = []

    async def gate(d: Delivery, call_next: Handler) -> Decision | None:
        return Decision.dead_letter("rejected", "gate closed")

    async def behave(d: Delivery) -> None:
        called.append(1)

    consumer = variant.consumer(conn, c, behave, middlewares=[gate])
    async with running(consumer):
        await publish_envelopes(js, c.subject, 1)
        await wait_until(lambda: c.count("dead_lettered", reason="rejected") == 1)
    assert called == []


def _raw(variant: Variant, conn: Connection, c: Case) -> tuple[Consumer, list[Delivery]]:
    """A consumer that hands raw deliveries (``decode=False``) to a list."""
    seen: list[Delivery] = []

    async def behave(d: Delivery) -> None:
        seen.append(d)

    return variant.consumer(conn, c, behave, decode=False), seen


@each_variant()
async def test_decode_false_hands_raw_bytes_and_headers(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    c = Case.new()
    consumer, seen = _raw(variant, conn, c)
    async with running(consumer):
        await js.publish(c.subject, b"raw bytes", headers={"Idempotency-Key": "k1"})
        await wait_until(lambda: len(seen) == 1)
    [d] = seen
    assert d.envelope is None and d.data == b"raw bytes"
    assert d.key == "k1" and d.headers["Idempotency-Key"] == "k1"
    assert d.timestamp.utcoffset() == timedelta(0)  # the stored time, in UTC


@each_variant()
async def test_a_stored_message_with_a_status_header_of_its_own_is_handled(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    """A ``Status`` header a publisher set is data, not the server's status of a pull
    request (those come without a reply subject): it is handed out and acked, once."""
    c = Case.new()
    consumer, seen = _raw(variant, conn, c)
    async with running(consumer):
        for status in ("404", "408", "100", "409"):
            await js.publish(
                c.subject, status.encode(), headers={"Status": status, "Description": "x"}
            )
        await wait_until(lambda: len(seen) == 4)
        await wait_until(lambda: c.count("acked") == 4)
    assert sorted(d.data for d in seen) == [b"100", b"404", b"408", b"409"]
    assert {d.num_delivered for d in seen} == {1}


@each_variant()
async def test_the_inbox_acks_a_redelivery_after_commit_without_a_second_effect(
    variant: Variant, conn: Connection, js: JetStreamContext, inbox_store: Store
) -> None:
    """The handler committed but its ack was lost: the redelivery finds the key processed."""
    c = Case.new()
    runs: list[int] = []

    def counted(delivery: Delivery, tx: Transaction) -> None:
        runs.append(delivery.num_delivered)
        credit(delivery, tx)

    inboxed = with_inbox(inbox_store, c.durable, counted, metrics=c.metrics)

    async def lose_first_ack(d: Delivery) -> Decision | None:
        result = await inboxed(d)
        return Decision.nak(0) if d.num_delivered == 1 else result

    consumer = variant.consumer(conn, c, lose_first_ack)
    async with running(consumer):
        env = await publish(js, c.subject, "once", 7)
        await wait_until(lambda: c.count("acked") == 1)
    assert runs == [1]
    assert credits(inbox_store) == [("once", 7)]
    assert c.count("duplicates_skipped") == 1
    assert c.count("redeliveries") == 1
    [row] = list(inbox_store.inbox_read(c.durable))
    assert row.key == "once" and row.message_id == env.id and row.status == "processed"
