"""Dead letters: routing a message to ``failed.<subject>``, inspecting and re-driving it.

A dead letter is the original body with the original headers plus the ``Dlq-*`` headers
of CONTRACT.md. ``Dlq-*`` is the runtime's reserved namespace: a producer's own copy of
such a header is renamed ``Producer-Dlq-...`` here, the one gate, so every tool after it
may trust a ``Dlq-*`` header as the router's. Its ``Nats-Msg-Id`` is the original's (or
``dlq-<stream>-<seq>``), so a dead letter written twice after a crash is stored once.
A dead letter that would not fit the server's limits is truncated (body cut, longest
headers dropped, ``Dlq-Truncated`` saying what was cut) and the whole original is kept
beside it (``meshforge.deadletters.originals``) until it is re-driven or purged.

Example::

    await dead_letter(publisher, msg, reason="unrecoverable", error=exc, consumer="order_consumer")

    letters = DeadLetters(conn.js, publisher)
    for letter in await letters.list(limit=20):
        print(letter.seq, letter.original_subject, letter.reason, letter.error)
    await letters.redrive(letter.seq)   # back to the original subject, then removed
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from meshforge.deadletters.originals import (
    keep_original,
    original_copy_subject,
)
from meshforge.envelope import H_MSG_ID, now_ts
from meshforge.errors import InvalidSubject, PublishError, one_line
from meshforge.topology.subjects import (
    dead_letter_subject,
    original_of_dead_letter,
)
from meshforge.transport.headers import RESERVED_PREFIX, producer_headers, text_headers
from meshforge.transport.sizes import Fitted, check_fits

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from meshforge.publish.publisher import Publisher, PublishResult

__all__ = [
    "H_DLQ_CONSUMER",
    "H_DLQ_DELIVERIES",
    "H_DLQ_ERROR",
    "H_DLQ_ORIGINAL_SUBJECT",
    "H_DLQ_REASON",
    "H_DLQ_STREAM",
    "H_DLQ_STREAM_SEQ",
    "H_DLQ_TIMESTAMP",
    "H_DLQ_TRUNCATED",
    "REASONS",
    "DeadLetter",
    "dead_letter",
    "redrive_id",
]

log = logging.getLogger("meshforge.deadletter")

H_DLQ_REASON = "Dlq-Reason"
H_DLQ_ERROR = "Dlq-Error"
H_DLQ_DELIVERIES = "Dlq-Deliveries"
H_DLQ_ORIGINAL_SUBJECT = "Dlq-Original-Subject"
H_DLQ_STREAM = "Dlq-Stream"
H_DLQ_STREAM_SEQ = "Dlq-Stream-Seq"
H_DLQ_CONSUMER = "Dlq-Consumer"
H_DLQ_TIMESTAMP = "Dlq-Timestamp"
H_DLQ_TRUNCATED = "Dlq-Truncated"
H_DLQ_ORIGINAL = "Dlq-Original"
DLQ_PREFIX = RESERVED_PREFIX
# A longer original id is not reused as the dead letter's (it could not be kept whole).
_MAX_ID = 256
_REDRIVE_SUFFIX = re.compile(r"(?:-redrive-\d+)+$")

_OURS = (
    H_DLQ_REASON,
    H_DLQ_ERROR,
    H_DLQ_DELIVERIES,
    H_DLQ_ORIGINAL_SUBJECT,
    H_DLQ_STREAM,
    H_DLQ_STREAM_SEQ,
    H_DLQ_CONSUMER,
    H_DLQ_TIMESTAMP,
)
REASON_MALFORMED = "malformed"
REASON_UNRECOVERABLE = "unrecoverable"
REASON_MAX_DELIVERIES = "max_deliveries"
REASON_EXPIRED = "expired"
REASON_REJECTED = "rejected"
REASON_INVALID_PAYLOAD = "invalid_payload"
#: Every ``Dlq-Reason`` a dead letter may carry (CONTRACT.md).
REASONS = (
    REASON_MALFORMED,
    REASON_UNRECOVERABLE,
    REASON_MAX_DELIVERIES,
    REASON_EXPIRED,
    REASON_REJECTED,
    REASON_INVALID_PAYLOAD,
)
ERROR_LIMIT = 1024

# Server directives that would apply to the dead-letter publish itself (and make it fail
# or expire) rather than describe the message; they are not carried over.
_DIRECTIVES = frozenset(
    h.lower()
    for h in (
        "Nats-Expected-Stream",
        "Nats-Expected-Last-Sequence",
        "Nats-Expected-Last-Subject-Sequence",
        "Nats-Expected-Last-Msg-Id",
        "Nats-Rollup",
        "Nats-TTL",
    )
)


def _error_text(error: str | BaseException | None, reason: str) -> str:
    if isinstance(error, BaseException):
        return one_line(error, ERROR_LIMIT)
    text = (error or reason).replace("\r", " ").replace("\n", " ")
    raw = text.encode("utf-8")
    return (
        text
        if len(raw) <= ERROR_LIMIT
        else raw[: ERROR_LIMIT - 3].decode("utf-8", "ignore") + "..."
    )


async def dead_letter(
    publisher: Publisher,
    msg: Msg,
    *,
    reason: str,
    error: str | BaseException | None,
    consumer: str,
) -> PublishResult:
    """Publish ``msg`` to ``failed.<msg.subject>`` with the ``Dlq-*`` headers; wait for the PubAck.

    ``msg`` must be a JetStream message (its metadata names the stream and sequence).
    Raises ``PublishError`` when the dead letter cannot be stored: the caller must then
    not ack the original.

    Example::

        await dead_letter(publisher, msg, reason="malformed", error=exc, consumer="order_consumer")
    """
    if reason not in REASONS:
        raise ValueError(f"reason must be one of {', '.join(REASONS)}, got {reason!r}")
    meta = msg.metadata
    stream, seq = meta.stream, meta.sequence.stream
    # Text only (no email Header objects), and no producer copy of a reserved header.
    original = producer_headers(text_headers(msg.headers))
    headers = {k: v for k, v in original.items() if k.lower() not in _DIRECTIVES}
    headers.update(
        {
            H_DLQ_REASON: reason,
            H_DLQ_ERROR: _error_text(error, reason),
            H_DLQ_DELIVERIES: str(meta.num_delivered),
            H_DLQ_ORIGINAL_SUBJECT: msg.subject,
            H_DLQ_STREAM: stream,
            H_DLQ_STREAM_SEQ: str(seq),
            H_DLQ_CONSUMER: consumer,
            H_DLQ_TIMESTAMP: now_ts(),
        }
    )
    msg_id = original.get(H_MSG_ID) or ""
    if not msg_id or len(msg_id) > _MAX_ID:
        msg_id = f"dlq-{stream}-{seq}"
    headers[H_MSG_ID] = msg_id
    try:
        subject = dead_letter_subject(msg.subject)
    except InvalidSubject as exc:
        raise PublishError(
            f"cannot dead-letter {stream} #{seq}: {exc}", kind="invalid_subject"
        ) from None
    fitted = await _fit(publisher, subject, msg, headers, original, stream, seq)
    result = await publisher.publish(subject, fitted.data, headers=fitted.headers, msg_id=msg_id)
    log.debug(  # the consumer logs each dead letter once, at the level its reason deserves
        "dead-lettered %s #%d (%s) from %s as %s #%d%s: %s",
        stream, seq, msg.subject, consumer, result.stream, result.seq,
        f" (truncated: {fitted.cut})" if fitted.cut else "", headers[H_DLQ_ERROR],
    )  # fmt: skip
    return result


async def _fit(
    publisher: Publisher,
    subject: str,
    msg: Msg,
    headers: dict[str, str],
    original: dict[str, str],
    stream: str,
    seq: int,
) -> Fitted:
    """The dead letter as it fits; a truncated one has its whole original kept first."""
    try:
        check_fits(subject, msg.data, headers, publisher.limits())
    except PublishError:
        pass
    else:
        return Fitted(msg.data, headers)
    headers[H_DLQ_ORIGINAL] = original_copy_subject(stream, seq)
    keep = [*_OURS, H_DLQ_ORIGINAL, H_MSG_ID]
    fitted = publisher.fit(subject, msg.data, headers, mark=H_DLQ_TRUNCATED, keep=keep)
    await keep_original(publisher, msg.subject, msg.data, original, stream, seq)
    return fitted


def redrive_id(msg_id: str, dead_letter_seq: int) -> str:
    """``Nats-Msg-Id`` of a re-driven message: the original id would be dropped as a
    duplicate inside the server's window, so each re-drive of a dead letter gets its own.
    It is derived from the first id: a message re-driven again does not grow its id.

    >>> redrive_id(redrive_id("x", 2), 4)
    'x-redrive-4'
    """
    return f"{_REDRIVE_SUFFIX.sub('', msg_id)}-redrive-{dead_letter_seq}"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One stored dead letter; ``seq`` (its sequence in the dead-letter stream) is its id."""

    seq: int
    subject: str
    original_subject: str
    reason: str
    error: str
    deliveries: int | None
    stream: str
    stream_seq: int | None
    consumer: str
    timestamp: str
    stored_at: datetime | None
    msg_id: str | None
    data: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def original_headers(self) -> dict[str, str]:
        """The headers the original message had (every ``Dlq-*`` removed)."""
        return _without_dlq(self.headers)

    @property
    def truncated(self) -> str:
        """What was cut to make it fit (``Dlq-Truncated``), or "" for a whole dead letter."""
        return self.headers.get(H_DLQ_TRUNCATED, "")

    @property
    def original_copy(self) -> str:
        """Where the whole original of a truncated dead letter is kept ("" when whole, or
        when the letter names no source). Derived from the letter's own stream and sequence,
        never taken from a header: ``failed.original.<stream>.<seq>``, a literal subject."""
        if not self.truncated or not self.stream or self.stream_seq is None:
            return ""
        try:
            return original_copy_subject(self.stream, self.stream_seq)
        except InvalidSubject:
            return ""


def _without_dlq(headers: Mapping[str, str]) -> dict[str, str]:
    """Headers fit to publish again: no ``Dlq-*``, no server directives."""
    prefix = DLQ_PREFIX.lower()
    return {
        k: v
        for k, v in headers.items()
        if not k.lower().startswith(prefix) and k.lower() not in _DIRECTIVES
    }


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _letter(
    seq: int, subject: str, data: bytes, headers: Mapping[str, object], stored: datetime | None
) -> DeadLetter:
    h = text_headers(headers)
    original = h.get(H_DLQ_ORIGINAL_SUBJECT)
    if not original:
        try:
            original = original_of_dead_letter(subject)
        except InvalidSubject:
            original = ""
    return DeadLetter(
        seq=seq,
        subject=subject,
        original_subject=original,
        reason=h.get(H_DLQ_REASON, ""),
        error=h.get(H_DLQ_ERROR, ""),
        deliveries=_int(h.get(H_DLQ_DELIVERIES)),
        stream=h.get(H_DLQ_STREAM, ""),
        stream_seq=_int(h.get(H_DLQ_STREAM_SEQ)),
        consumer=h.get(H_DLQ_CONSUMER, ""),
        timestamp=h.get(H_DLQ_TIMESTAMP, ""),
        stored_at=stored,
        msg_id=h.get(H_MSG_ID),
        data=data,
        headers=h,
    )
