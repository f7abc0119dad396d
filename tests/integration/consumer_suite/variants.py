"""The consumer conformance suite: each behaviour written once, run for every way of consuming.

A ``Variant`` is one way a ``Consumer`` takes messages. Each test of this folder is
parametrised with ``each_variant(...)`` and runs, against the session's nats-server, for
every variant that has the capabilities it names:

============  ======  ================  ===========================================
variant       mode    handler           capabilities
============  ======  ================  ===========================================
pull-single   pull    ``handler``       ``MIDDLEWARES``
push-single   push    ``handler``       ``MIDDLEWARES``, ``DELIVER_GROUP``
pull-batch    pull    ``batch_handler`` ``BATCHES``
(push-batch)  push    ``batch_handler`` refused by design: ``ConfigError`` (a push
                                        consumer is handed one message at a time)
============  ======  ================  ===========================================

Where the variants differ by design, a capability says so:

- ``MIDDLEWARES``: the middleware chain (tracing, logging, metrics, the caller's, the
  handler timeout) wraps a handler of one delivery. A batch handler is one call for a
  whole fetch and runs without it: a consumer refuses ``middlewares=`` with one, and its
  ``handler_timeout`` bounds the whole batch.
- ``DELIVER_GROUP``: the server pushes to a deliver group and caps what it hands out at
  ``max_ack_pending`` = the consumer's concurrency; a pull consumer asks for what it can
  take.
- ``BATCHES``: the handler gets one fetch at a time (at most ``batch_size``), and the
  consumer holds two batches at most by default (``max_held``), the next one fetched
  while one finishes.

Tests write a behaviour as a function of one delivery (``Behave``); ``Variant.consumer``
makes it the handler, or a batch handler that runs it for each delivery of the fetch at
once and raises the first error it raised (a batch handler's error decides for the
whole batch).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pytest
from consumer_support import counter_value, settings, subject_for, unique_agent
from nats.js import JetStreamContext

from meshforge.config import Settings
from meshforge.consume.consumer import Consumer, Decision, Delivery, Handler
from meshforge.consume.decisions import BatchHandler
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
from meshforge.ops.observability import Metrics
from meshforge.topology.specs import ConsumerSpec, agent_consumer
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.connection import Connection

MIDDLEWARES = "middlewares"
DELIVER_GROUP = "deliver_group"
BATCHES = "batches"

Behave = Handler  # what a test does with one delivery: None (ack), a Decision, or raise


@dataclass(frozen=True)
class Variant:
    """One way of consuming: pull or push, a handler or a batch handler."""

    name: str
    mode: Literal["pull", "push"]
    batch: bool
    capabilities: frozenset[str]

    def __str__(self) -> str:
        return self.name

    def __contains__(self, capability: str) -> bool:
        return capability in self.capabilities

    def capacity(self, consumer: Consumer) -> int:
        """The most messages the consumer holds unacknowledged at once."""
        return consumer.max_held if self.batch else consumer.concurrency

    def consumer(
        self,
        conn: Connection,
        case: Case,
        behave: Behave,
        *,
        calls: list[int] | None = None,
        **options: Any,
    ) -> Consumer:
        """A consumer of this variant for the case's durable (with its settings and metrics
        unless ``options`` say otherwise) running ``behave`` for each delivery; ``calls``
        gets the number of deliveries each handler call was given."""
        options = {"settings": case.settings, "metrics": case.metrics, "mode": self.mode, **options}
        if self.batch:
            return Consumer(conn, case.spec, batch_handler=as_batch(behave, calls), **options)
        return Consumer(conn, case.spec, handler=counting(behave, calls), **options)


def counting(behave: Behave, calls: list[int] | None) -> Handler:
    """``behave``, noting each call in ``calls`` (when given)."""
    if calls is None:
        return behave

    async def counted(d: Delivery) -> Decision | None:
        calls.append(1)
        return await behave(d)

    return counted


def as_batch(behave: Behave, calls: list[int] | None = None) -> BatchHandler:
    """A batch handler running ``behave`` for every delivery of the batch at once; the
    first error raised is the batch's."""

    async def handle_batch(ds: Sequence[Delivery]) -> list[Decision]:
        if calls is not None:
            calls.append(len(ds))
        results = await asyncio.gather(*(behave(d) for d in ds), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [result or Decision.ack() for result in results]  # type: ignore[misc]

    return handle_batch


VARIANTS = (
    Variant("pull-single", "pull", batch=False, capabilities=frozenset({MIDDLEWARES})),
    Variant(
        "push-single", "push", batch=False, capabilities=frozenset({MIDDLEWARES, DELIVER_GROUP})
    ),
    Variant("pull-batch", "pull", batch=True, capabilities=frozenset({BATCHES})),
)
_KNOWN = frozenset().union(*(v.capabilities for v in VARIANTS))


def each_variant(*needs: str) -> pytest.MarkDecorator:
    """Parametrise ``variant`` with every variant that has all of ``needs``."""
    unknown = set(needs) - _KNOWN
    if unknown:
        raise ValueError(f"unknown capabilities: {sorted(unknown)}")
    chosen = [v for v in VARIANTS if all(n in v for n in needs)]
    return pytest.mark.parametrize("variant", chosen, ids=str)


@dataclass(frozen=True)
class Case:
    """One test's agent: its settings, its durable on MESHFORGE_COMMANDS, fresh metrics."""

    agent: str
    settings: Settings
    spec: ConsumerSpec
    metrics: Metrics

    @classmethod
    def new(cls, **values: object) -> Case:
        """A new agent with settings from ``values`` and defaults only."""
        agent, s = unique_agent(), settings(**values)
        return cls(agent, s, agent_consumer(agent, s), Metrics())

    @property
    def durable(self) -> str:
        return self.spec.durable

    @property
    def subject(self) -> str:
        """Where a command to the agent goes."""
        return subject_for(self.agent)

    def count(self, metric: str, **labels: str) -> float:
        """The value of one of the case's metrics (``acked``, ``naked``, ...) for its durable."""
        return counter_value(getattr(self.metrics, metric), consumer=self.durable, **labels)


# ------------------------------------------------------------------ the server's view


async def ack_pending(js: JetStreamContext, durable: str) -> int:
    return (await js.consumer_info(STREAM_COMMANDS, durable)).num_ack_pending or 0


async def redelivered_and_pending(js: JetStreamContext, durable: str) -> tuple[int, int]:
    """How many messages the server delivered again, and how many it awaits acks for."""
    info = await js.consumer_info(STREAM_COMMANDS, durable)
    return info.num_redelivered or 0, info.num_ack_pending or 0


async def settled(js: JetStreamContext, durable: str) -> bool:
    """Nothing unacknowledged nor undelivered, and the ack floor moved."""
    info = await js.consumer_info(STREAM_COMMANDS, durable)
    floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
    return info.num_ack_pending == 0 and (info.num_pending or 0) == 0 and (floor or 0) > 0


@contextlib.asynccontextmanager
async def sampling_ack_pending(js: JetStreamContext, durable: str) -> AsyncIterator[list[int]]:
    """Sample the server's num_ack_pending for the consumer until the block ends."""
    samples: list[int] = []
    done = asyncio.Event()

    async def sample() -> None:
        # A flag, not cancellation: Python 3.11's wait_for (inside nats-py requests) can
        # swallow a cancel that races with the reply.
        while not done.is_set():
            samples.append(await ack_pending(js, durable))
            await asyncio.sleep(0.02)  # sampling period

    task = asyncio.create_task(sample())
    try:
        yield samples
    finally:
        done.set()
        await asyncio.wait_for(task, 10)


def assert_contract_headers(
    msg: object, *, reason: str, subject: str, durable: str, deliveries: int
) -> None:
    """The CONTRACT's dead-letter headers, as the consumer writes them."""
    headers = msg.headers or {}  # type: ignore[attr-defined]
    assert headers[H_DLQ_REASON] == reason
    assert headers[H_DLQ_ORIGINAL_SUBJECT] == subject
    assert headers[H_DLQ_STREAM] == STREAM_COMMANDS
    assert int(headers[H_DLQ_STREAM_SEQ]) > 0
    assert headers[H_DLQ_CONSUMER] == durable
    assert headers[H_DLQ_DELIVERIES] == str(deliveries)
    assert headers[H_DLQ_TIMESTAMP].endswith("Z")
    assert "\n" not in headers[H_DLQ_ERROR] and len(headers[H_DLQ_ERROR].encode()) <= 1024
