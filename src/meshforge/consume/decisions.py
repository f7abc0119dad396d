"""What happens to a delivered message: the ``Decision`` a handler returns or its error maps to.

A handler returns ``None`` (ack), a ``Decision``, or raises; what an error (or any other
failure on a message's way) becomes is decided in one place, ``meshforge.consume.policy``
(see docs/OPERATIONS.md, "Ack decisions").

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

from meshforge.deadletters.route import (
    REASON_EXPIRED,
    REASON_INVALID_PAYLOAD,
    REASON_MALFORMED,
    REASON_MAX_DELIVERIES,
    REASON_REJECTED,
    REASON_UNRECOVERABLE,
)
from meshforge.envelope import Envelope
from meshforge.errors import one_line

if TYPE_CHECKING:
    from nats.aio.msg import Msg

__all__ = [
    "REASON_EXPIRED",
    "REASON_INVALID_PAYLOAD",
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
]


class Action(Enum):
    """The things a consumer can do with a message."""

    ACK = "ack"
    NAK = "nak"
    TERM = "term"
    DEAD_LETTER = "dead_letter"
    #: Keep it: the server waits another ack wait before it delivers it again.
    IN_PROGRESS = "in_progress"


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
    def in_progress(cls) -> Decision:
        """Still working on it: the server waits another ack wait before redelivering."""
        return cls(Action.IN_PROGRESS)

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
            stream, seq, delivered, named = (
                meta.stream,
                meta.sequence.stream,
                meta.num_delivered,
                meta.consumer,
            )
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
