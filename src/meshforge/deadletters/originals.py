"""The full original of a truncated dead letter: kept in chunks beside it, read back, removed.

A work-queue stream deletes a message once it is acked (or terminated), so when a dead
letter has to be truncated to fit, the whole original (its headers and body) is first
copied into the dead-letter stream on ``failed.original.<stream>.<seq>``, the stream and
sequence it came from. The copy is one or more chunks, each small enough for
``max_payload``: the original's headers as a JSON object, then its body, cut in order.
Each chunk carries ``Dlq-Chunk: <i>/<n>`` and ``Dlq-Original-Headers: <bytes of the JSON>``
and a ``Nats-Msg-Id`` derived from the original's place, so a copy written again after a
crash is stored once (within the duplicate window; later copies are read as one).

Example::

    subject = await keep_original(publisher, msg.subject, msg.data, dict(msg.headers or {}),
                                  "MESHFORGE_COMMANDS", 42)
    original = await read_original(js, "MESHFORGE_FAILED", subject)
    print(original.subject, len(original.data))
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import nats.js.errors
from nats.js import JetStreamContext

from meshforge.envelope import H_MSG_ID, Outbound
from meshforge.errors import InvalidSubject, MeshForgeError
from meshforge.topology.subjects import validate_subject
from meshforge.transport.headers import text_headers

if TYPE_CHECKING:
    from nats.js.api import RawStreamMsg

    from meshforge.publish.publisher import Publisher

__all__ = [
    "H_DLQ_CHUNK",
    "H_DLQ_ORIGINAL_HEADERS",
    "ORIGINAL_PREFIX",
    "Original",
    "is_original_copy",
    "keep_original",
    "literal_copy",
    "original_copy_subject",
    "read_original",
    "remove_original",
]

ORIGINAL_PREFIX = "failed.original."
H_DLQ_CHUNK = "Dlq-Chunk"
H_DLQ_ORIGINAL_HEADERS = "Dlq-Original-Headers"
H_DLQ_ORIGINAL_SUBJECT = "Dlq-Original-Subject"
# Room left in each chunk for its own few headers.
_CHUNK_HEADROOM = 1024


@dataclass(frozen=True, slots=True)
class Original:
    """A message as it was first stored: its subject, headers and whole body."""

    subject: str
    headers: dict[str, str]
    data: bytes


def original_copy_subject(stream: str, seq: int) -> str:
    """``failed.original.<stream>.<seq>``: where the original of ``stream`` #``seq`` is kept."""
    return validate_subject(f"{ORIGINAL_PREFIX}{stream}.{seq}")


def literal_copy(copy: str) -> str:
    """``copy`` if it is one kept original's literal subject (``failed.original.<stream>.<seq>``,
    no wildcard), else ``MeshForgeError``: nothing is read or removed by pattern."""
    try:
        validate_subject(copy)
    except InvalidSubject as exc:
        raise MeshForgeError(f"not a kept original's subject: {exc}") from None
    tokens = copy.split(".")
    if not copy.startswith(ORIGINAL_PREFIX) or len(tokens) != 4 or not tokens[3].isdecimal():
        raise MeshForgeError(
            f"not a kept original's subject: {copy[:80]!r} (expected {ORIGINAL_PREFIX}<stream>.<seq>)"
        )
    return copy


def is_original_copy(subject: str) -> bool:
    """Whether ``subject`` holds a kept original (not a dead letter)."""
    return subject.startswith(ORIGINAL_PREFIX)


async def keep_original(
    publisher: Publisher, subject: str, data: bytes, headers: dict[str, str], stream: str, seq: int
) -> str:
    """Copy the message ``stream`` #``seq`` (on ``subject``) into chunks; return their subject.

    Raises ``PublishError`` when a chunk cannot be stored: the caller must then keep the
    original (not ack it).
    """
    copy = original_copy_subject(stream, seq)
    head = json.dumps(headers, ensure_ascii=False, separators=(",", ":")).encode()
    blob = head + data
    room = max(1, publisher.limits().max_payload - _CHUNK_HEADROOM)
    count = max(1, -(-len(blob) // room))
    items = []
    for index in range(count):
        msg_id = f"dlq-original-{stream}-{seq}-{index + 1}"
        chunk_headers = {
            H_DLQ_CHUNK: f"{index + 1}/{count}",
            H_DLQ_ORIGINAL_HEADERS: str(len(head)),
            H_DLQ_ORIGINAL_SUBJECT: subject,
            H_MSG_ID: msg_id,
        }
        part = blob[index * room : (index + 1) * room]
        items.append(Outbound(subject=copy, data=part, headers=chunk_headers, msg_id=msg_id))
    await publisher.publish_many(items)
    return copy


def _chunk(headers: dict[str, str]) -> tuple[int, int] | None:
    index, _, total = headers.get(H_DLQ_CHUNK, "").partition("/")
    try:
        i, n = int(index), int(total)
    except ValueError:
        return None
    return (i, n) if 1 <= i <= n else None


async def read_original(
    js: JetStreamContext, stream: str, copy: str, *, subject_of: str | None = None
) -> Original:
    """The original kept on ``copy`` (a literal subject) in ``stream``; raises
    ``MeshForgeError`` when it is missing or incomplete, or (with ``subject_of``) when it
    was kept for another subject than ``subject_of``: a letter reads only its own."""
    literal_copy(copy)
    parts: dict[int, bytes] = {}
    total: int | None = None
    head_len = 0
    subject = ""
    async for raw in _stored(js, stream, copy):
        headers = text_headers(raw.headers)
        place = _chunk(headers)
        if place is None:
            continue
        index, total = place
        parts.setdefault(index, raw.data or b"")  # a copy stored twice reads as one
        head_len = int(headers.get(H_DLQ_ORIGINAL_HEADERS, "0") or 0)
        subject = headers.get(H_DLQ_ORIGINAL_SUBJECT, subject)
        if subject_of is not None and subject != subject_of:
            raise MeshForgeError(
                f"the original kept on {copy} is of another subject than its dead letter's"
            )
        if len(parts) == total:
            break
    if total is None or len(parts) < total:
        found = f"{len(parts)} of {total} chunks" if total else "nothing"
        raise MeshForgeError(f"the original kept on {copy} is missing ({found} in {stream})")
    blob = b"".join(parts[i] for i in range(1, total + 1))
    try:
        kept = json.loads(blob[:head_len])
    except ValueError:
        raise MeshForgeError(f"the original kept on {copy} has unreadable headers") from None
    headers_out = {str(k): str(v) for k, v in kept.items()} if isinstance(kept, dict) else {}
    return Original(subject=subject, headers=headers_out, data=blob[head_len:])


async def _stored(js: JetStreamContext, stream: str, copy: str) -> AsyncIterator[RawStreamMsg]:
    """The messages stored on the literal subject ``copy``, in stream order."""
    seq = 1
    while True:
        try:
            raw = await js.get_msg(stream, seq=seq, subject=copy, next=True)
        except nats.js.errors.NotFoundError:
            return
        if raw.seq is None:
            return
        yield raw
        seq = raw.seq + 1


async def remove_original(js: JetStreamContext, stream: str, copy: str) -> int:
    """Delete every chunk of the original kept on ``copy``, a literal subject, one stream
    sequence at a time (nothing there is fine); returns how many were deleted."""
    literal_copy(copy)
    seqs = [raw.seq async for raw in _stored(js, stream, copy) if raw.seq is not None]
    for found in seqs:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_msg(stream, found)
    return len(seqs)
