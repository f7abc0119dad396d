"""From fetched message to decision: admission, the handler run, and its outcome.

``Processor`` is the part of a consumer that works on messages it already holds: it
turns each into a ``Delivery``, dead-letters what must not reach the handler (a
malformed body, a delivery past the limit), runs the handler chain (or the batch
handler) with ``in_progress`` heartbeats, and hands the decisions to the ``Acker``. What
a refusal or an error becomes is the failure policy's (``meshforge.consume.policy``).

Example (what ``Consumer`` does for each fetched message)::

    processor = Processor("order_consumer", acker, metrics, limits, chain=handler)
    await processor.handle_one(msg)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshforge.consume.ack import Acker
from meshforge.consume.decisions import (
    REASON_MALFORMED,
    REASON_REJECTED,
    Action,
    BatchHandler,
    Decision,
    Delivery,
    Handler,
)
from meshforge.consume.policy import Cause, FailurePolicy, Outcome
from meshforge.envelope import H_TENANT, decode
from meshforge.errors import MalformedMessage
from meshforge.ops.observability import Metrics
from meshforge.topology.scope import Scope, tenant_conflict

if TYPE_CHECKING:
    from nats.aio.msg import Msg

__all__ = ["Budget", "Limits", "Processor", "Workers"]

log = logging.getLogger("meshforge.consumer")

_CANCEL_GRACE = 5.0  # seconds a cancelled handler gets to unwind at shutdown


@dataclass(frozen=True, slots=True)
class Limits:
    """The consumer's delivery limits as the server has them, and ours.

    ``max_deliver`` None: no client-side exhaustion. ``server_max`` -1: unlimited.
    ``ack_wait`` and ``wait_backoff`` say how long the server waits for each delivery's ack.
    """

    max_deliver: int | None
    server_max: int
    ack_wait: float
    wait_backoff: tuple[float, ...] = ()

    def keepalive_period(self, num_delivered: int) -> float:
        """A third of the shortest time the server waits for this delivery's ack."""
        wait = self.ack_wait
        if self.wait_backoff:
            wait = min(wait, self.wait_backoff[min(num_delivered, len(self.wait_backoff)) - 1])
        return max(wait / 3, 0.01)


class Processor:
    """Handles messages one by one (``handle_one``) or a fetch at a time (``handle_batch``)."""

    def __init__(
        self,
        consumer: str,
        acker: Acker,
        metrics: Metrics,
        limits: Limits,
        *,
        chain: Handler | None = None,
        batch_handler: BatchHandler | None = None,
        decode: bool = True,
        unrecoverable: tuple[type[BaseException], ...] = (),
        batch_timeout: float | None = None,
    ) -> None:
        self.consumer = consumer
        self.acker = acker
        self.limits = limits
        self._chain = chain
        self._batch_handler = batch_handler
        self._decode = decode
        #: What a refusal, a handler error or a nak on the last delivery becomes.
        self.policy = FailurePolicy(
            max_deliver=limits.max_deliver, backoff=acker.backoff,
            unrecoverable=unrecoverable, server_max=limits.server_max,
        )  # fmt: skip
        self._batch_timeout = batch_timeout
        label = {"consumer": consumer}
        self._consumed = metrics.consumed.labels(**label)
        self._redelivered = metrics.redeliveries.labels(**label)
        self._batch_seconds = metrics.handler_seconds.labels(**label)

    def admit(self, msg: Msg) -> tuple[Delivery, Decision | None]:
        """A delivery, and a decision when it must not reach the handler."""
        self._consumed.inc()
        return self._admit(msg)

    def _admit(self, msg: Msg) -> tuple[Delivery, Decision | None]:
        """``admit`` but for the consumed count, which a batch adds up once."""
        delivery = Delivery.of(msg, self.consumer)
        if delivery.num_delivered > 1:
            self._redelivered.inc()
        if self._decode:
            try:
                delivery.envelope = decode(
                    msg.data, delivery.headers, default_ts=lambda: delivery.stored_ts
                )
            except MalformedMessage as exc:
                return delivery, self.policy.decide(
                    Outcome(Cause.REFUSED, error=exc, reason=REASON_MALFORMED)
                )
        conflict = _tenant_conflict(delivery)
        if conflict is not None:
            return delivery, self.policy.decide(
                Outcome(Cause.REFUSED, error=conflict, reason=REASON_REJECTED)
            )
        if self.policy.past_limit(delivery.num_delivered):
            return delivery, self.policy.decide(Outcome(Cause.EXHAUSTED, delivery.num_delivered))
        return delivery, None

    def decide(self, exc: BaseException, delivery: Delivery) -> Decision:
        """The decision for a handler error (see ``meshforge.consume.policy``)."""
        return self.policy.decide(Outcome(Cause.HANDLER, delivery.num_delivered, exc))

    async def handle_one(self, msg: Msg) -> None:
        """Admit, run the handler chain with heartbeats, apply the decision."""
        assert self._chain is not None
        delivery, decision = self.admit(msg)
        if decision is None:
            period = self.limits.keepalive_period(delivery.num_delivered)
            async with self.acker.keep_alive([msg], period):
                try:
                    decision = await self._chain(delivery) or Decision.ack()
                except Exception as exc:
                    decision = self.decide(exc, delivery)
            decision = self.policy.review(decision, delivery.num_delivered)
        await self.acker.apply(delivery, decision)

    async def handle_batch(self, msgs: list[Msg]) -> None:
        """Admit each, run the batch handler once for the admitted ones, apply every decision."""
        assert self._batch_handler is not None
        ready: list[Delivery] = []
        settled: list[tuple[Delivery, Decision]] = []
        self._consumed.inc(len(msgs))
        for msg in msgs:
            delivery, decision = self._admit(msg)
            if decision is None:
                ready.append(delivery)
            else:
                settled.append((delivery, decision))
        if ready:
            settled += await self._run_batch(ready)
        # A plain ack only writes to the connection's buffer: one write for all of them.
        acks = []
        others = []
        for delivery, decision in settled:
            if decision.action is Action.ACK and not self.acker.ack_sync:
                acks.append(delivery)
            else:
                others.append(self.acker.apply(delivery, decision))
        await self.acker.ack_all(acks)
        if others:
            await asyncio.gather(*others)

    async def _run_batch(self, ready: list[Delivery]) -> list[tuple[Delivery, Decision]]:
        assert self._batch_handler is not None
        period = self.limits.keepalive_period(max(d.num_delivered for d in ready))
        start = time.perf_counter()
        async with self.acker.keep_alive([d.msg for d in ready], period):
            try:
                async with asyncio.timeout(self._batch_timeout):
                    decisions = list(await self._batch_handler(ready))
                if len(decisions) != len(ready):
                    raise RuntimeError(
                        f"batch handler returned {len(decisions)} decisions for {len(ready)} messages"
                    )
            except Exception as exc:
                log.warning("batch handler failed: %s", exc, extra={"consumer": self.consumer})
                decisions = [self.decide(exc, d) for d in ready]
        self._batch_seconds.observe(time.perf_counter() - start)
        review = self.policy.review
        return [
            (d, review(dec or Decision.ack(), d.num_delivered))
            for d, dec in zip(ready, decisions, strict=True)
        ]


def _tenant_conflict(delivery: Delivery) -> str | None:
    """Why a command's header or body claims another tenant than its subject (refused
    ``rejected``); otherwise None, and the envelope takes the subject's tenant (what its
    outputs carry)."""
    if not delivery.subject.startswith("cmd."):
        return None
    scope = Scope.of_subject(delivery.subject)
    if scope is None:
        return None
    env = delivery.envelope
    header = delivery.headers.get(H_TENANT)
    body = env.body_tenant_id if env is not None else None
    agreed = (None, "", scope.tenant)  # what tenant_conflict lets pass
    conflict = (
        None
        if header in agreed and body in agreed
        else tenant_conflict(scope, header=header, body=body)
    )
    if conflict is not None:
        return conflict
    if env is not None:
        env.tenant_id = scope.tenant
    return None


def _wake_all(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)


class Budget:
    """Room for held messages shared by the consumers that feed one engine (a worker's
    partitions in one lane): each fetches only what the lane has room for.

    Without it each of a lane's durables held the engine's ``max_held``: 16 partitions
    on one worker held 16 times what the lane's transactions could reach within a first
    ack wait, and every one of them was kept alive with ``in_progress`` meanwhile (a
    beat a third of an ack wait for each). A pause of the machine then let the server
    hand thousands out again.
    """

    __slots__ = ("_waiters", "held")

    def __init__(self) -> None:
        #: Messages held, and asked for by fetches still under way (so two consumers of
        #: the lane fetching at once cannot both take the same room). The limit is each
        #: consumer's ``max_held``: the engine's.
        self.held = 0
        self._waiters: list[asyncio.Future[None]] = []

    def add(self, n: int) -> None:
        """``n`` more held or asked for (fewer, if negative: that wakes the waiters)."""
        self.held += n
        if n < 0:
            waiters, self._waiters = self._waiters, []
            _wake_all(waiters)

    def wake_me(self, waiter: asyncio.Future[None]) -> None:
        """``waiter`` is resolved when room is next freed."""
        self._waiters.append(waiter)


class Workers:
    """The tasks working on held messages, and the capacity they leave free (the
    consumer's own, or with a ``Budget`` the room its engine's lane has left)."""

    def __init__(
        self, consumer: str, metrics: Metrics, stop: asyncio.Event, budget: Budget | None = None
    ) -> None:
        self.consumer = consumer
        self._stop = stop
        self._budget = budget
        self._tasks: dict[asyncio.Task[None], list[Msg]] = {}
        self._held = 0  # messages in self._tasks, kept as a count: read on every fetch
        # Who waits in ``wait_free``: woken when a task ends or the stop is set. A future
        # each, not two tasks and an ``asyncio.wait`` per wait (one for every fetch).
        self._waiters: list[asyncio.Future[None]] = []
        self._stop_watch: asyncio.Task[None] | None = None
        self._gauge = metrics.in_flight.labels(consumer=consumer)

    @property
    def in_flight(self) -> int:
        """Messages held now (being handled or waiting for their decision to be sent)."""
        return self._held

    @property
    def load(self) -> int:
        """What a fetch's room is counted against: the lane's held messages with a
        ``Budget``, else this consumer's."""
        return self._budget.held if self._budget is not None else self._held

    def spawn(self, work: Coroutine[Any, Any, None], msgs: list[Msg]) -> None:
        """Run ``work`` for ``msgs`` in a task; they count as in flight until it ends."""
        task = asyncio.create_task(work)
        self._tasks[task] = msgs
        self._held += len(msgs)
        if self._budget is not None:
            self._budget.add(len(msgs))
        self._gauge.set(self._held)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        n = len(self._tasks.pop(task, ()))
        self._held -= n
        self._gauge.set(self._held)
        if self._budget is not None:
            self._budget.add(-n)
        self._wake()
        if not task.cancelled() and task.exception() is not None:
            log.error("consumer %s: worker failed", self.consumer, exc_info=task.exception())

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        _wake_all(waiters)

    async def _wake_at_stop(self) -> None:
        await self._stop.wait()
        self._wake()

    async def wait_free(self, limit: int) -> bool:
        """Wait until fewer than ``limit`` are in flight (``load``); False when stopping."""
        while self.load >= limit and not self._stop.is_set():
            if self._stop_watch is None or self._stop_watch.done():
                self._stop_watch = asyncio.ensure_future(self._wake_at_stop())
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            if self._budget is not None:
                self._budget.wake_me(waiter)  # another consumer of the lane freed room
            try:
                await waiter
            except asyncio.CancelledError:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
                raise
        return not self._stop.is_set()

    async def finish(self, grace: float, nak: Callable[[Msg], Awaitable[None]]) -> int:
        """Give in-flight work ``grace`` seconds; nak and cancel the rest; how many were nak'ed."""
        if self._stop_watch is not None:
            self._stop_watch.cancel()
        if self._tasks:
            log.info(
                "consumer %s: waiting up to %.1fs for %d in flight",
                self.consumer,
                grace,
                self.in_flight,
            )
            await asyncio.wait(list(self._tasks), timeout=grace)
        left = dict(self._tasks)
        count = 0
        for task, msgs in left.items():
            for msg in msgs:
                await nak(msg)
                count += 1
            task.cancel()
        if left:
            log.warning("consumer %s: nak'ed %d unfinished message(s)", self.consumer, count)
            # Bounded: a handler that swallows its cancellation must not hold up the stop.
            await asyncio.wait(list(left), timeout=_CANCEL_GRACE)
        return count
