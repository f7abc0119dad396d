"""What happens to a delivered message: the ``Decision`` a handler returns or its error maps to.

A handler returns ``None`` (ack), a ``Decision``, or raises. ``decide`` turns an error into
a decision with one policy (see docs/OPERATIONS.md, "Ack decisions"):

=====================================  =============================================
error                                  decision
=====================================  =============================================
``Retry(delay)``                        nak after ``delay`` (or the backoff entry)
``MalformedMessage``                    dead letter ``malformed``
``Unrecoverable`` or a configured class dead letter ``unrecoverable``
``Rejected`` / ``Expired``              dead letter ``rejected`` / ``expired``
anything else, a handler timeout        nak with backoff; dead letter
                                        ``max_deliveries`` on the last attempt
=====================================  =============================================

Example::

    async def handle(delivery: Delivery) -> Decision | None:
        if delivery.envelope.payload.get("qty", 0) <= 0:
            return Decision.dead_letter("rejected", "qty must be positive")
        return None  # ack
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import TYPE_CHECKING, Any

from meshforge.envelope import Envelope
from meshforge.errors import (
    Expired,
    MalformedMessage,
    Rejected,
    Retry,
    Unrecoverable,
    one_line,
)

if TYPE_CHECKING:
    from nats.aio.msg import Msg

__all__ = [
    "REASON_EXPIRED",
    "REASON_MALFORMED",
    "REASON_MAX_DELIVERIES",
    "REASON_REJECTED",
    "REASON_UNRECOVERABLE",
    "Action",
    "BatchHandler",
    "Decision",
    "Delivery",
    "Handler",
    "Middleware",
    "backoff_delay",
    "decide",
]

REASON_MALFORMED = "malformed"
REASON_UNRECOVERABLE = "unrecoverable"
REASON_MAX_DELIVERIES = "max_deliveries"
REASON_EXPIRED = "expired"
REASON_REJECTED = "rejected"


class Action(Enum):
    """The four things a consumer can do with a message."""

    ACK = "ack"
    NAK = "nak"
    TERM = "term"
    DEAD_LETTER = "dead_letter"


@dataclass(frozen=True, slots=True)
class Decision:
    """One message's fate. ``delay`` is for NAK (None: the backoff schedule, 0: at once);
    ``reason`` and ``error`` are for DEAD_LETTER.

    >>> Decision.nak(2.5).delay
    2.5
    """

    action: Action
    delay: float | None = None
    reason: str | None = None
    error: str | None = None

    @classmethod
    def ack(cls) -> Decision:
        """Done: remove the message."""
        return _ACK

    @classmethod
    def nak(cls, delay: float | None = None) -> Decision:
        """Deliver again after ``delay`` seconds (None: the backoff for this attempt)."""
        return cls(Action.NAK, delay=delay)

    @classmethod
    def term(cls) -> Decision:
        """Stop delivering it, without a dead letter (the server keeps an advisory)."""
        return cls(Action.TERM)

    @classmethod
    def dead_letter(cls, reason: str, error: str | BaseException | None = None) -> Decision:
        """Publish to ``failed.<subject>`` with ``Dlq-Reason: reason``, then ack."""
        text = one_line(error) if isinstance(error, BaseException) else error
        return cls(Action.DEAD_LETTER, reason=reason, error=text)


_ACK = Decision(Action.ACK)


@dataclass(slots=True)
class Delivery:
    """One delivery of a JetStream message to a consumer.

    ``timestamp`` is the time the stream stored the message (UTC); ``num_delivered`` counts
    this delivery (1 the first time); ``pending``, the messages the consumer still had to
    deliver after this one when the server sent it (its backlog). ``envelope`` is None
    only for a consumer built with ``decode=False``. ``metadata`` is for middlewares to
    pass facts inward (each middleware module names its keys as constants).
    """

    msg: Msg
    subject: str
    data: bytes
    headers: dict[str, str]
    stream: str
    seq: int
    num_delivered: int
    timestamp: datetime
    envelope: Envelope | None = None
    consumer: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    pending: int = 0

    @classmethod
    def of(cls, msg: Msg, consumer: str = "") -> Delivery:
        """A delivery from a nats-py JetStream message (envelope not decoded yet)."""
        tokens = msg.reply.split(".") if msg.reply else []
        if len(tokens) == 9 and tokens[0] == "$JS" and tokens[1] == "ACK":
            # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>
            stream, seq, delivered, named = tokens[2], int(tokens[5]), int(tokens[4]), tokens[3]
            stamp = datetime.fromtimestamp(int(tokens[7]) / 1e9, UTC)
            pending = int(tokens[8])
        else:  # nats-py knows every form (domains); this one is rarer
            meta = msg.metadata
            stream, seq, delivered, named = meta.stream, meta.sequence.stream, meta.num_delivered, meta.consumer
            stamp, pending = meta.timestamp, meta.num_pending or 0
        return cls(
            msg=msg, subject=msg.subject, data=msg.data, headers=dict(msg.headers or {}),
            stream=stream, seq=seq, num_delivered=delivered, timestamp=stamp, consumer=consumer or named,
            pending=pending,
        )  # fmt: skip

    @property
    def stored_ts(self) -> str:
        """``timestamp`` as RFC 3339 with microseconds and Z."""
        return self.timestamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    @property
    def key(self) -> str:
        """The idempotency key: the envelope's, else the headers', else ``stream:seq``."""
        if self.envelope is not None:
            return self.envelope.key
        return (
            self.headers.get("Idempotency-Key")
            or self.headers.get("Nats-Msg-Id")
            or f"{self.stream}:{self.seq}"
        )


Handler = Callable[[Delivery], Awaitable[Decision | None]]
BatchHandler = Callable[[Sequence[Delivery]], Awaitable[Sequence[Decision]]]
Middleware = Callable[[Delivery, Handler], Awaitable[Decision | None]]


def backoff_delay(num_delivered: int, backoff: Sequence[float]) -> float | None:
    """The nak delay for this attempt: ``backoff[num_delivered - 1]``, the last entry after
    the schedule runs out, None (at once) without a schedule.

    >>> backoff_delay(2, (1.0, 5.0)), backoff_delay(9, (1.0, 5.0))
    (5.0, 5.0)
    """
    if not backoff:
        return None
    return backoff[min(max(num_delivered, 1), len(backoff)) - 1]


def decide(
    exc: BaseException,
    num_delivered: int,
    *,
    max_deliver: int | None,
    backoff: Sequence[float],
    unrecoverable: tuple[type[BaseException], ...] = (),
) -> Decision:
    """The decision for a handler error on delivery ``num_delivered``.

    ``max_deliver`` None means no client-side exhaustion (the server's MaxDeliver rules).

    >>> decide(ValueError("x"), 1, max_deliver=3, backoff=(1.0,)).action
    <Action.NAK: 'nak'>
    >>> decide(ValueError("x"), 3, max_deliver=3, backoff=(1.0,)).reason
    'max_deliveries'
    """
    if isinstance(exc, MalformedMessage):
        return Decision.dead_letter(REASON_MALFORMED, exc)
    if isinstance(exc, Unrecoverable) or (unrecoverable and isinstance(exc, unrecoverable)):
        return Decision.dead_letter(REASON_UNRECOVERABLE, exc)
    if isinstance(exc, Rejected):
        return Decision.dead_letter(REASON_REJECTED, exc)
    if isinstance(exc, Expired):
        return Decision.dead_letter(REASON_EXPIRED, exc)
    if max_deliver is not None and num_delivered >= max_deliver:
        return Decision.dead_letter(REASON_MAX_DELIVERIES, exc)
    if isinstance(exc, Retry) and exc.delay is not None:
        return Decision.nak(exc.delay)
    return Decision.nak(backoff_delay(num_delivered, backoff))
