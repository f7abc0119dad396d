"""The failure policy: what becomes of a message that was not simply handled.

Every path that turns an outcome into ack, nak (with a delay), in-progress, term or a dead
letter asks ``FailurePolicy.decide``: the consumer's admission and handler runs
(``consume/work.py``), the sending of a dead letter (``consume/ack.py``), and the effect
engine's handler runs, transactions, holds and publishes (``runtime/``). None of them
decides on its own. An ``Outcome`` says what happened (its ``Cause``), on which attempt
(deliveries held back behind an earlier command of their resource are not attempts), with
which error; the policy answers with a ``Decision``:

=================  =============================================  ===========================
cause              what happened                                  decision
=================  =============================================  ===========================
``HANDLER``        ``MalformedMessage``                           dead letter ``malformed``
                   ``InvalidPayload`` (not its declared type)     dead letter ``invalid_payload``
                   ``Unrecoverable`` or a configured class        dead letter ``unrecoverable``
                   ``Rejected`` / ``Expired``                     dead letter ``rejected`` /
                                                                  ``expired``
                   anything else on the last attempt              dead letter ``max_deliveries``
                   ``Retry(delay)``                               nak after ``delay``
                   anything else (``HandlerTimeout`` too)         nak after the backoff entry
``STORE``          the store is out (disk full, read-only, down)  in progress: pause, try again
                   busy, locked, a conflict (after the retries)   nak after ``STORE_RETRY_DELAY``
                   ``invalid`` (data it can never hold)           dead letter ``unrecoverable``
                   anything else (corrupt, a constraint...)       as a ``HANDLER`` error
``PUBLISH``        the server is away, slow or its store failing  in progress: pause, try again
                   outputs not published for another reason       nak after the backoff entry
``FORWARD``        not forwarded to its partition's subject       nak after ``STORE_RETRY_DELAY``
``DEAD_LETTER``    its dead letter could not be published         nak after the backoff entry
                                                                  (``DEAD_LETTER_RETRY_DELAY``
                                                                  without a schedule)
``REFUSED``        admission refused it (a bad body or header,    dead letter ``reason``
                   another tenant's, an unknown command)
``HELD``           behind an earlier command of its resource      nak after ``delay``
``STOP_FAILED``    the stop behind its dead letter not stored     nak after ``STORE_RETRY_DELAY``
``EXHAUSTED``      delivered after its last attempt               dead letter ``max_deliveries``
``LAST_NAK``       a nak of the delivery the server will not      dead letter ``max_deliveries``
                   deliver again (its MaxDeliver reached)
=================  =============================================  ===========================

A dead letter's reason is always one of the contract's (``REASONS``). With
``stop_after_dead_letter`` (``Agent.hold_after_dead_letter``) every dead letter of a
command with a resource stops that resource (``stops``), whichever cause led to it.

Example::

    policy = FailurePolicy(max_deliver=5, backoff=(1.0, 5.0))
    policy.decide(Outcome(Cause.HANDLER, attempt=2, error=RuntimeError("away")))
    # Decision(action=<Action.NAK: 'nak'>, delay=5.0, ...)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from meshforge.consume.decisions import (
    REASON_EXPIRED,
    REASON_INVALID_PAYLOAD,
    REASON_MALFORMED,
    REASON_MAX_DELIVERIES,
    REASON_REJECTED,
    REASON_UNRECOVERABLE,
    Action,
    Decision,
)
from meshforge.deadletters.route import REASONS
from meshforge.errors import (
    Expired,
    InvalidPayload,
    MalformedMessage,
    PublishError,
    Rejected,
    Retry,
    StoreError,
    Unrecoverable,
)

__all__ = [
    "DEAD_LETTER_RETRY_DELAY",
    "REASONS",
    "SERVER_OUTAGES",
    "STORE_OUTAGES",
    "STORE_RETRY_DELAY",
    "Cause",
    "FailurePolicy",
    "Outcome",
    "backoff_delay",
    "is_outage",
]

#: ``StoreError.kind`` values that are about the store, never about the message.
STORE_OUTAGES = frozenset({"unavailable"})
#: ``PublishError.kind`` values that are the server's state (away, slow, its storage
#: failing), not the message's.
SERVER_OUTAGES = frozenset({"connection", "timeout", "unavailable", "store_failed"})
#: Nak delay for what is not the command's fault (a busy store, a forward): soon, and
#: without burning the backoff schedule.
STORE_RETRY_DELAY = 0.5
#: Nak delay when a dead letter could not be published and there is no backoff schedule.
DEAD_LETTER_RETRY_DELAY = 1.0


class Cause(Enum):
    """What happened to a message (see the module's table)."""

    HANDLER = "handler"
    STORE = "store"
    PUBLISH = "publish"
    FORWARD = "forward"
    DEAD_LETTER = "dead_letter"
    REFUSED = "refused"
    HELD = "held"
    STOP_FAILED = "stop_failed"
    EXHAUSTED = "exhausted"
    LAST_NAK = "last_nak"


@dataclass(frozen=True, slots=True)
class Outcome:
    """One input of the policy. ``attempt`` counts this delivery among the attempts (1 the
    first time); ``error`` is the exception (or its text) behind it; ``reason`` is the
    dead-letter reason of a ``REFUSED``; ``delay`` the nak delay of a ``HELD`` (None: the
    backoff entry of its attempt)."""

    cause: Cause
    attempt: int = 1
    error: BaseException | str | None = None
    reason: str | None = None
    delay: float | None = None


def backoff_delay(attempt: int, backoff: Sequence[float]) -> float | None:
    """The nak delay for this attempt: ``backoff[attempt - 1]``, the last entry after the
    schedule runs out, None (at once) without a schedule.

    >>> backoff_delay(2, (1.0, 5.0)), backoff_delay(9, (1.0, 5.0))
    (5.0, 5.0)
    """
    if not backoff:
        return None
    return backoff[min(max(attempt, 1), len(backoff)) - 1]


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` says the store is out (every message would fail alike)."""
    return isinstance(exc, StoreError) and exc.kind in STORE_OUTAGES


_IN_PROGRESS = Decision(Action.IN_PROGRESS)


def _dead(reason: str, error: BaseException | str | None) -> Decision:
    """A dead letter whose ``Dlq-Error`` always says something."""
    return Decision.dead_letter(reason, error if error else f"dead-lettered as {reason}")


@dataclass(frozen=True, slots=True)
class FailurePolicy:
    """The rules of one consumer (or agent): its limit, backoff schedule, the error classes
    it takes as unrecoverable, and whether a dead letter stops its resource.

    ``max_deliver`` None: no client-side exhaustion (the server's MaxDeliver rules);
    ``server_max`` is that MaxDeliver (-1: unlimited).

    >>> FailurePolicy(max_deliver=3, backoff=(1.0,)).decide(Outcome(Cause.HANDLER, 3, ValueError("x"))).reason
    'max_deliveries'
    """

    max_deliver: int | None = None
    backoff: tuple[float, ...] = ()
    unrecoverable: tuple[type[BaseException], ...] = ()
    server_max: int = -1
    stop_after_dead_letter: bool = False

    def decide(self, outcome: Outcome) -> Decision:
        """The decision for ``outcome`` (see the module's table)."""
        cause, attempt, error = outcome.cause, outcome.attempt, outcome.error
        if cause is Cause.HANDLER:
            return self._handler(error, attempt)
        if cause is Cause.STORE:
            if isinstance(error, StoreError):
                if error.kind in STORE_OUTAGES:
                    return _IN_PROGRESS
                if error.kind == "invalid":  # deterministic: every retry would fail alike
                    return _dead(REASON_UNRECOVERABLE, error)
                if not error.retriable:
                    return self._handler(error, attempt)
            return Decision.nak(STORE_RETRY_DELAY)  # busy, locked, a conflict: not its fault
        if cause is Cause.PUBLISH:
            if isinstance(error, PublishError) and error.kind in SERVER_OUTAGES:
                return _IN_PROGRESS
            return Decision.nak(self.delay(attempt))
        if cause in (Cause.FORWARD, Cause.STOP_FAILED):
            return Decision.nak(STORE_RETRY_DELAY)
        if cause is Cause.DEAD_LETTER:
            return Decision.nak(self.delay(attempt) or DEAD_LETTER_RETRY_DELAY)
        if cause is Cause.REFUSED:
            reason = outcome.reason or REASON_UNRECOVERABLE
            if reason not in REASONS:
                raise ValueError(f"reason must be one of {', '.join(REASONS)}, got {reason!r}")
            return _dead(reason, error)
        if cause is Cause.HELD:
            return Decision.nak(outcome.delay if outcome.delay is not None else self.delay(attempt))
        if cause is Cause.EXHAUSTED:
            return _dead(
                REASON_MAX_DELIVERIES, f"attempted {attempt} times; the limit is {self.max_deliver}"
            )
        return _dead(REASON_MAX_DELIVERIES, error or "nak on the last delivery")

    def _handler(self, error: BaseException | str | None, attempt: int) -> Decision:
        if isinstance(error, MalformedMessage):
            return _dead(REASON_MALFORMED, error)
        if isinstance(error, InvalidPayload):
            return _dead(REASON_INVALID_PAYLOAD, error)
        if isinstance(error, Unrecoverable) or (
            self.unrecoverable and isinstance(error, self.unrecoverable)
        ):
            return _dead(REASON_UNRECOVERABLE, error)
        if isinstance(error, Rejected):
            return _dead(REASON_REJECTED, error)
        if isinstance(error, Expired):
            return _dead(REASON_EXPIRED, error)
        if self.max_deliver is not None and attempt >= self.max_deliver:
            return _dead(REASON_MAX_DELIVERIES, error)
        if isinstance(error, Retry) and error.delay is not None:
            return Decision.nak(error.delay)
        return Decision.nak(self.delay(attempt))

    def delay(self, attempt: int) -> float | None:
        """The backoff entry of this attempt (a nak that named no delay waits this long)."""
        return backoff_delay(attempt, self.backoff)

    def past_limit(self, attempt: int) -> bool:
        """Whether this delivery comes after the last attempt (``EXHAUSTED``: never run)."""
        return self.max_deliver is not None and attempt > self.max_deliver

    def review(self, decision: Decision, attempt: int) -> Decision:
        """A handler's decision, unless it is a nak the server would never act on (its
        MaxDeliver is reached: the message would strand): then ``LAST_NAK``."""
        if (
            decision.action is Action.NAK
            and self.max_deliver is not None
            and 0 < self.server_max <= attempt
        ):
            return self.decide(Outcome(Cause.LAST_NAK, attempt))
        return decision

    def stops(self, decision: Decision) -> bool:
        """Whether this decision stops its command's resource (``stop_after_dead_letter``)."""
        return self.stop_after_dead_letter and decision.action is Action.DEAD_LETTER
