"""Conformance (see variants.py): around the handler, for every variant: middlewares and
their order (a handler of one delivery only, by design), raw bytes without decoding, and
the inbox turning a redelivered message into a duplicate."""

from __future__ import annotations

from datetime import timedelta

import pytest
from consumer_support import (
    counter_value,
    publish_envelopes,
    running,
    settings,
    subject_for,
    unique_agent,
    wait_until,
)
from inbox_support import credit, credits, publish
from nats.js import JetStreamContext
from variants import MIDDLEWARES, Variant, each_variant

from meshforge.consume.consumer import Decision, Delivery, Handler
from meshforge.consume.inbox import with_inbox
from meshforge.consume.middleware.tracing import SPAN_ID, TRACE_ID
from meshforge.errors import ConfigError
from meshforge.ops.observability import Metrics
from meshforge.store import Store, Transaction
from meshforge.topology.specs import agent_consumer
from meshforge.transport.connection import Connection


@each_variant()
async def test_middlewares_run_in_order_inside_tracing(
    variant: Variant, conn: Connection, js: JetStreamContext
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

    async def behave(d: Delivery) -> None:
        order.append("handler")

    middlewares = [named("outer"), named("inner")]
    if MIDDLEWARES not in variant:
        # A batch handler is one call for a whole fetch: middlewares of one delivery would
        # not run, and the consumer says so rather than drop them.
        with pytest.raises(ConfigError, match="a batch handler runs without them"):
            variant.consumer(conn, spec, behave, settings=s, middlewares=middlewares)
        return
    consumer = variant.consumer(
        conn, spec, behave, settings=s, metrics=Metrics(), middlewares=middlewares
    )
    async with running(consumer):
        [env] = await publish_envelopes(js, subject_for(agent), 1)
        await wait_until(lambda: len(order) == 5)
    assert order == ["outer>", "inner>", "handler", "<inner", "<outer"]
    assert traces == [(env.trace_id, env.span_id)]


@each_variant(MIDDLEWARES)
async def test_a_middleware_can_decide_without_the_handler(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    s = settings()
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    called: list[int] = []

    async def gate(d: Delivery, call_next: Handler) -> Decision | None:
        return Decision.dead_letter("rejected", "gate closed")

    async def behave(d: Delivery) -> None:
        called.append(1)

    consumer = variant.consumer(conn, spec, behave, settings=s, metrics=metrics, middlewares=[gate])
    async with running(consumer):
        await publish_envelopes(js, subject_for(agent), 1)
        await wait_until(
            lambda: counter_value(metrics.dead_lettered, consumer=spec.durable, reason="rejected") == 1
        )
    assert called == []


@each_variant()
async def test_decode_false_hands_raw_bytes_and_headers(
    variant: Variant, conn: Connection, js: JetStreamContext
) -> None:
    s = settings()
    agent = unique_agent()
    spec = agent_consumer(agent, s)
    seen: list[Delivery] = []

    async def behave(d: Delivery) -> None:
        seen.append(d)

    consumer = variant.consumer(conn, spec, behave, settings=s, metrics=Metrics(), decode=False)
    async with running(consumer):
        await js.publish(subject_for(agent), b"raw bytes", headers={"Idempotency-Key": "k1"})
        await wait_until(lambda: len(seen) == 1)
    [d] = seen
    assert d.envelope is None and d.data == b"raw bytes"
    assert d.key == "k1" and d.headers["Idempotency-Key"] == "k1"
    assert d.timestamp.utcoffset() == timedelta(0)  # the stored time, in UTC


@each_variant()
async def test_the_inbox_acks_a_redelivery_after_commit_without_a_second_effect(
    variant: Variant, conn: Connection, js: JetStreamContext, inbox_store: Store
) -> None:
    """The handler committed but its ack was lost: the redelivery finds the key processed."""
    s = settings()
    agent, metrics = unique_agent(), Metrics()
    spec = agent_consumer(agent, s)
    runs: list[int] = []

    def counted(delivery: Delivery, tx: Transaction) -> None:
        runs.append(delivery.num_delivered)
        credit(delivery, tx)

    inboxed = with_inbox(inbox_store, spec.durable, counted, metrics=metrics)

    async def lose_first_ack(d: Delivery) -> Decision | None:
        result = await inboxed(d)
        return Decision.nak(0) if d.num_delivered == 1 else result

    consumer = variant.consumer(conn, spec, lose_first_ack, settings=s, metrics=metrics)
    async with running(consumer):
        env = await publish(js, subject_for(agent), "once", 7)
        await wait_until(lambda: counter_value(metrics.acked, consumer=spec.durable) == 1)
    assert runs == [1]
    assert credits(inbox_store) == [("once", 7)]
    assert counter_value(metrics.duplicates_skipped, consumer=spec.durable) == 1
    assert counter_value(metrics.redeliveries, consumer=spec.durable) == 1
    [row] = list(inbox_store.inbox_read(spec.durable))
    assert row.key == "once" and row.message_id == env.id and row.status == "processed"
