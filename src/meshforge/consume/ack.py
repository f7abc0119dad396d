"""Carrying out decisions: ack, nak, term, dead letter; and keeping long handlers alive.

``Acker.apply`` sends what a ``Decision`` says and counts it. A dead letter is published
(and its PubAck awaited) before the original is acked; when that publish fails the
original is nak'ed instead (the delay is the failure policy's, ``meshforge.consume.policy``),
so a message is never acked without its dead letter.
``keep_alive`` sends ``in_progress`` every third of the ack wait while a handler runs
(one task per consumer does it for every handler that runs that long).

Example::

    acker = Acker("order_consumer", metrics, lambda: publisher, backoff=(1, 5, 10))
    async with acker.keep_alive([delivery.msg], period=10.0):
        decision = await handler(delivery)
    await acker.apply(delivery, decision)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from nats.errors import MsgAlreadyAckdError

from meshforge.consume.decisions import (
    REASON_MALFORMED,
    REASON_MAX_DELIVERIES,
    REASON_REJECTED,
    Action,
    Decision,
    Delivery,
)
from meshforge.consume.policy import Cause, FailurePolicy, Outcome
from meshforge.errors import one_line
from meshforge.ops.faults import crash_point
from meshforge.ops.observability import Metrics, observe_many

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from meshforge.publish.publisher import Publisher

__all__ = ["Acker"]

log = logging.getLogger("meshforge.consumer")

_REFUSED_AT_ADMISSION = frozenset({REASON_MALFORMED, REASON_REJECTED})

# A delayed nak must say some delay: 0 would be a plain nak (redelivered at once).
_LEAST_DELAY = 0.001


class Acker:
    """Sends acks, naks, terms and dead letters for one consumer and counts them."""

    def __init__(
        self,
        consumer: str,
        metrics: Metrics,
        publisher: Callable[[], Publisher],
        *,
        backoff: Sequence[float] = (),
        ack_sync: bool = False,
        ack_timeout: float = 5.0,
        server_wait: tuple[float, tuple[float, ...]] = (0.0, ()),
    ) -> None:
        self.consumer = consumer
        self.backoff = tuple(backoff)
        #: What a failed dead letter and a nak without a delay become (its backoff only).
        self.policy = FailurePolicy(backoff=self.backoff)
        #: The consumer's AckWait and BackOff as the server has them (see ``nak_delay``).
        self.server_wait = server_wait
        self.ack_sync = ack_sync
        self.ack_timeout = ack_timeout
        self._publisher = publisher
        label = {"consumer": consumer}
        self._acked = metrics.acked.labels(**label)
        self._naked = metrics.naked.labels(**label)
        self._exhausted = metrics.deliveries_exhausted.labels(**label)
        self._dead = metrics.dead_lettered
        self._e2e = metrics.end_to_end_seconds.labels(**label)
        self._heartbeats = Heartbeats()

    async def apply(self, delivery: Delivery, decision: Decision) -> None:
        """Carry out ``decision`` for ``delivery``. Never raises for a send failure: the
        server redelivers a message whose ack was lost once its ack wait passes."""
        msg = delivery.msg
        try:
            if decision.action is Action.ACK:
                await self._ack(delivery)
            elif decision.action is Action.NAK:
                delay = decision.delay
                if delay is None:
                    delay = self.policy.delay(delivery.num_delivered)
                await msg.nak(self.nak_delay(delay, delivery.num_delivered))
                self._naked.inc()
            elif decision.action is Action.TERM:
                await msg.term()
            elif decision.action is Action.IN_PROGRESS:
                await msg.in_progress()
                return
            else:
                await self._dead_letter(delivery, decision)
                return
        except MsgAlreadyAckdError:
            return  # shutdown already nak'ed it
        except Exception as exc:  # connection trouble: the ack wait brings it back
            log.warning(
                "could not %s %s seq %d: %s (it is redelivered after the ack wait)",
                decision.action.value,
                delivery.subject,
                delivery.seq,
                one_line(exc, 300),
                extra={"consumer": self.consumer, "stream_seq": delivery.seq},
            )
            return
        crash_point("after_ack")

    async def ack_all(self, deliveries: Sequence[Delivery]) -> None:
        """Ack every delivery: one write for all on a MeshForge connection, else one
        ``apply`` each. Never raises for a send failure (see ``apply``)."""
        if not deliveries:
            return
        ack_many = None if self.ack_sync else getattr(deliveries[0].msg._client, "ack_many", None)
        if ack_many is not None:
            try:
                await ack_many([d.msg for d in deliveries])
            except Exception:  # one of them cannot be acked this way: each on its own
                pass
            else:
                self._count_acked(deliveries)
                for _ in deliveries:
                    crash_point("after_ack")
                return
        for delivery in deliveries:
            await self.apply(delivery, Decision.ack())

    async def _ack(self, delivery: Delivery) -> None:
        if self.ack_sync:
            await delivery.msg.ack_sync(timeout=self.ack_timeout)
        else:
            await delivery.msg.ack()
        self._count_acked((delivery,))

    def _count_acked(self, deliveries: Sequence[Delivery]) -> None:
        self._acked.inc(len(deliveries))
        now = time.time()
        observe_many(self._e2e, [max(0.0, now - d.timestamp.timestamp()) for d in deliveries])

    async def _dead_letter(self, delivery: Delivery, decision: Decision) -> None:
        from meshforge.deadletters.route import dead_letter

        reason = decision.reason or "unrecoverable"
        try:
            await dead_letter(
                self._publisher(),
                delivery.msg,
                reason=reason,
                error=decision.error,
                consumer=self.consumer,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never ack what was not dead-lettered: nak, try again later
            retry = self.policy.decide(Outcome(Cause.DEAD_LETTER, delivery.num_delivered, exc))
            delay = retry.delay
            log.error(
                "dead letter (%s) for %s seq %d failed: %s; nak'ed, retried in %.1fs",
                reason,
                delivery.subject,
                delivery.seq,
                one_line(exc, 300),
                delay,
                extra={"consumer": self.consumer, "stream_seq": delivery.seq},
            )
            await delivery.msg.nak(self.nak_delay(delay, delivery.num_delivered))
            self._naked.inc()
            return
        self._dead.labels(consumer=self.consumer, reason=reason).inc()
        if reason == REASON_MAX_DELIVERIES:
            self._exhausted.inc()
        # Seed 000: a command that will never be applied is CRITICAL. Input refused at the
        # door (malformed, rejected) is WARNING, so hostile traffic cannot flood that level.
        level = logging.WARNING if reason in _REFUSED_AT_ADMISSION else logging.CRITICAL
        log.log(
            level,
            "dead-lettered %s seq %d as %s: %s",
            delivery.subject,
            delivery.seq,
            reason,
            decision.error,
            extra={"consumer": self.consumer, "stream_seq": delivery.seq, "reason": reason},
        )
        await self._ack(delivery)
        crash_point("after_ack")

    def nak_delay(self, delay: float | None, num_delivered: int) -> float | None:
        """The delay to send for a redelivery ``delay`` seconds from now.

        On a consumer with a BackOff the server redelivers a delayed nak of delivery n
        after ``delay + BackOff[n-1] - AckWait`` (it backdates the nak by AckWait, then
        waits the attempt's BackOff entry): the configured 1s, 5s, 10s, 30s came as gaps
        of about 1, 9, 19 and 59 s. Sent less that difference, the gap is the one asked
        for; a delay shorter than the difference gets the difference (never sooner).
        """
        ack_wait, server_backoff = self.server_wait
        if not delay or not server_backoff:
            return delay
        extra = server_backoff[min(max(num_delivered, 1), len(server_backoff)) - 1] - ack_wait
        return max(delay - extra, _LEAST_DELAY) if extra > 0 else delay

    def keep_alive(self, msgs: Sequence[Msg], period: float) -> KeepAlive:
        """Send ``in_progress`` for ``msgs`` every ``period`` seconds until the block ends."""
        return KeepAlive(self._heartbeats, msgs, period)

    def silence(self) -> None:
        """No more ``in_progress``, for what is held now or later (the consumer was fenced)."""
        self._heartbeats.silence()


class Heartbeats:
    """One task sends ``in_progress`` for every held batch of messages that is due.

    Holding and releasing are a dict insert and delete: most handlers end long before
    their first beat, so they should cost nothing more. The task wakes every half of the
    shortest period held (a hold with a shorter period than that starts it again), so a
    batch's first beat comes between one and one and a half periods after it was taken;
    the consumer's period is a third of the ack wait of that delivery. The task ends
    when it wakes and finds nothing held.
    """

    def __init__(self) -> None:
        self._held: dict[int, tuple[float, float, Sequence[Msg]]] = {}  # key: (due, period, msgs)
        self._next_key = 0
        self._task: asyncio.Task[None] | None = None
        self._tick = 0.0  # how long the task sleeps between rounds
        self._silent = False

    def silence(self) -> None:
        self._silent = True
        self._held.clear()
        if self._task is not None:
            self._task.cancel()
            self._task = None
            self._tick = 0.0

    def hold(self, msgs: Sequence[Msg], period: float) -> int:
        self._next_key += 1
        if self._silent:
            return self._next_key
        self._held[self._next_key] = (time.monotonic() + period, period, msgs)
        if self._task is None or self._task.done() or period / 2 < self._tick:
            if self._task is not None:
                self._task.cancel()  # it sleeps too long for this hold
            self._tick = period / 2
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self._next_key

    def release(self, key: int) -> None:
        # The task is left to find nothing held at its next round and end: cancelling it
        # here and starting another for the next hold cost four loop callbacks a batch.
        self._held.pop(key, None)

    async def _run(self) -> None:
        while self._held:
            self._tick = min(period for _, period, _ in self._held.values()) / 2
            await asyncio.sleep(self._tick)
            now = time.monotonic()
            for key, (due, period, msgs) in list(self._held.items()):
                if due > now or key not in self._held:
                    continue
                self._held[key] = (now + period, period, msgs)
                for msg in msgs:
                    with contextlib.suppress(Exception):  # lost beats only risk a redelivery
                        await msg.in_progress()


class KeepAlive:
    """``async with``: the messages are held by ``Heartbeats`` while the block runs."""

    __slots__ = ("_heartbeats", "_key", "msgs", "period")

    def __init__(self, heartbeats: Heartbeats, msgs: Sequence[Msg], period: float) -> None:
        self._heartbeats = heartbeats
        self.msgs = msgs
        self.period = period
        self._key = 0

    async def __aenter__(self) -> None:
        self._key = self._heartbeats.hold(self.msgs, self.period)

    async def __aexit__(self, *exc_info: object) -> None:
        self._heartbeats.release(self._key)
