"""Dead letters: routing a message to ``failed.<subject>``, inspecting and re-driving it.

A dead letter is the original body with the original headers untouched plus the
``Dlq-*`` headers of CONTRACT.md. Its ``Nats-Msg-Id`` is the original's (or
``dlq-<stream>-<seq>``), so a dead letter written twice after a crash is stored once.

Example::

    await dead_letter(publisher, msg, reason="unrecoverable", error=exc, consumer="order_consumer")

    letters = DeadLetters(conn.js, publisher)
    for letter in await letters.list(limit=20):
        print(letter.seq, letter.original_subject, letter.reason, letter.error)
    await letters.redrive(letter.seq)   # back to the original subject, then removed
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from meshforge.envelope import H_MSG_ID, now_ts
from meshforge.errors import InvalidSubject, MeshForgeError, MissingTopology, PublishError, one_line
from meshforge.subjects import (
    STREAM_FAILED,
    dead_letter_subject,
    original_of_dead_letter,
    validate_subject,
)

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from meshforge.publisher import Publisher, PublishResult

__all__ = [
    "H_DLQ_CONSUMER",
    "H_DLQ_DELIVERIES",
    "H_DLQ_ERROR",
    "H_DLQ_ORIGINAL_SUBJECT",
    "H_DLQ_REASON",
    "H_DLQ_STREAM",
    "H_DLQ_STREAM_SEQ",
    "H_DLQ_TIMESTAMP",
    "REASONS",
    "DeadLetter",
    "DeadLetters",
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
DLQ_PREFIX = "Dlq-"

REASONS = ("malformed", "unrecoverable", "max_deliveries", "expired", "rejected")
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
    original = dict(msg.headers or {})
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
    msg_id = original.get(H_MSG_ID) or f"dlq-{stream}-{seq}"
    try:
        subject = dead_letter_subject(msg.subject)
    except InvalidSubject as exc:
        raise PublishError(
            f"cannot dead-letter {stream} #{seq}: {exc}", kind="invalid_subject"
        ) from None
    result = await publisher.publish(subject, msg.data, headers=headers, msg_id=msg_id)
    log.info(
        "dead-lettered %s #%d (%s) from %s as %s #%d: %s",
        stream, seq, msg.subject, consumer, result.stream, result.seq, headers[H_DLQ_ERROR],
    )  # fmt: skip
    return result


def redrive_id(msg_id: str, dead_letter_seq: int) -> str:
    """``Nats-Msg-Id`` of a re-driven message: the original id would be dropped as a
    duplicate inside the server's window, so each re-drive of a dead letter gets its own."""
    return f"{msg_id}-redrive-{dead_letter_seq}"


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
        return {
            k: v for k, v in self.headers.items() if not k.lower().startswith(DLQ_PREFIX.lower())
        }


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _letter(
    seq: int, subject: str, data: bytes, headers: Mapping[str, str], stored: datetime | None
) -> DeadLetter:
    h = dict(headers)
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


class DeadLetters:
    """Inspect, re-drive and purge the dead-letter stream (``MESHFORGE_FAILED``).

    Example::

        letters = DeadLetters(conn.js, Publisher(conn.js))
        print(await letters.count())
        await letters.redrive_all()
    """

    def __init__(
        self, js: JetStreamContext, publisher: Publisher, *, stream: str = STREAM_FAILED
    ) -> None:
        self.js = js
        self.publisher = publisher
        self.stream = stream

    def _missing(self) -> MissingTopology:
        return MissingTopology(
            f"stream {self.stream} does not exist: create the streams with `meshforge provision`"
        )

    async def count(self, subject_filter: str | None = None) -> int:
        """How many dead letters are stored (matching ``subject_filter``, e.g. ``failed.cmd.>``)."""
        try:
            if subject_filter:
                validate_subject(subject_filter, wildcards=True)
                info = await self.js.stream_info(self.stream, subjects_filter=subject_filter)
                return sum((info.state.subjects or {}).values())
            info = await self.js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            raise self._missing() from None
        return int(info.state.messages)

    async def list(self, limit: int = 100, subject_filter: str | None = None) -> list[DeadLetter]:
        """The oldest ``limit`` dead letters (matching ``subject_filter``), oldest first."""
        if subject_filter:
            validate_subject(subject_filter, wildcards=True)
        letters: list[DeadLetter] = []
        seq = 1
        while len(letters) < limit:
            try:
                raw = await self.js.get_msg(
                    self.stream, seq=seq, subject=subject_filter or ">", next=True
                )
            except nats.js.errors.NotFoundError as exc:
                if exc.err_code == 10059:  # the stream itself is missing
                    raise self._missing() from None
                break  # no message at or after seq
            if raw.seq is None:
                break
            letters.append(
                _letter(raw.seq, raw.subject or "", raw.data or b"", raw.headers or {}, raw.time)
            )
            seq = raw.seq + 1
        return letters

    async def get(self, seq: int) -> DeadLetter:
        """The dead letter with id ``seq``; raises ``MeshForgeError`` when there is none."""
        try:
            raw = await self.js.get_msg(self.stream, seq=seq)
        except nats.js.errors.NotFoundError as exc:
            if exc.err_code == 10059:
                raise self._missing() from None
            raise MeshForgeError(f"no dead letter with id {seq} in {self.stream}") from None
        return _letter(
            raw.seq or seq, raw.subject or "", raw.data or b"", raw.headers or {}, raw.time
        )

    async def redrive(self, seq: int) -> PublishResult:
        """Publish dead letter ``seq`` again to its original subject with its original body and
        headers, then delete it (only after the PubAck: a failed re-drive keeps it).

        The copy's ``Nats-Msg-Id`` is ``redrive_id(original id, seq)``, so re-driving the same
        dead letter twice (e.g. after a crash before the delete) stores it once.
        """
        letter = await self.get(seq)
        if not letter.original_subject:
            raise MeshForgeError(f"dead letter {seq} names no original subject: cannot re-drive it")
        headers = letter.original_headers
        msg_id = redrive_id(headers.get(H_MSG_ID) or f"dlq-{self.stream}-{seq}", seq)
        headers[H_MSG_ID] = msg_id
        result = await self.publisher.publish(
            letter.original_subject, letter.data, headers=headers, msg_id=msg_id
        )
        await self._delete(seq)
        log.info(
            "re-drove dead letter %d to %s (%s #%d)",
            seq,
            letter.original_subject,
            result.stream,
            result.seq,
        )
        return result

    async def redrive_all(
        self, subject_filter: str | None = None, *, batch: int = 100
    ) -> builtins.list[tuple[int, PublishResult]]:
        """Re-drive every dead letter (matching ``subject_filter``), oldest first; returns
        ``(dead letter id, result)`` pairs. Stops at the first failure (raising it)."""
        done: builtins.list[tuple[int, PublishResult]] = []
        while True:
            letters = await self.list(limit=batch, subject_filter=subject_filter)
            if not letters:
                return done
            for letter in letters:
                done.append((letter.seq, await self.redrive(letter.seq)))

    async def purge(self, subject_filter: str | None = None) -> int:
        """Delete every dead letter (matching ``subject_filter``); returns how many there were."""
        before = await self.count(subject_filter)
        try:
            await self.js.purge_stream(self.stream, subject=subject_filter)
        except nats.js.errors.NotFoundError:
            raise self._missing() from None
        log.info("purged %d dead letter(s) from %s", before, self.stream)
        return before

    async def _delete(self, seq: int) -> None:
        try:
            await self.js.delete_msg(self.stream, seq)
        except nats.js.errors.NotFoundError:
            pass  # deleted meanwhile (a concurrent re-drive or purge): the goal is met
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise MeshForgeError(
                f"dead letter {seq} was re-driven but could not be deleted ({one_line(exc, 200)}); "
                "re-driving it again stores no second copy"
            ) from None
