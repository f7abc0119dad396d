"""Listings that are never silently short: every key of a bucket, every subject of a stream.

nats-py's ``KeyValue.keys()`` and its watcher decide that the stored values are all
delivered from a consumer info taken *after* the consumer started delivering, and from
the pending count of each delivery; both come back short while keys are being rewritten
(a rewrite deletes the key's previous revision, and the server's pending count can reach
0 with messages still to come). Seen as 1-13% of listings of 1,000-3,000 presence keys
coming back short or empty: a listing that says "no nodes" when there are thousands is
worse than an error.

``read_latest`` trusts sequences and the stream's own subject list, never a pending count:

1. the bound: the sequence of the last message on the subjects (one request; none at all
   means the listing is truly empty);
2. the values: an ephemeral consumer delivers every stored message on the subjects, in
   order, until it has passed that sequence (its deliveries must be gap-free);
3. the check: the stream's per-subject counts (one request per 100,000 subjects) name every
   subject stored now; one rewritten while step 2 read past it is read directly (a few).

A read that cannot finish in ``READ_LIMIT`` seconds, or that sees a gap in the consumer's
deliveries (twice), raises ``IncompleteListing``: the caller says so instead of showing less.

Example::

    entries = await read_bucket(conn.js, "MESHFORGE_NODES", "plant3.>")
    for key, entry in sorted(entries.items()):
        print(key, entry.seq, entry.data)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from meshforge.errors import MeshForgeError

__all__ = [
    "READ_LIMIT",
    "Entry",
    "IncompleteListing",
    "last_message",
    "last_sequence",
    "read_bucket",
    "read_latest",
]

# The server's error code for "no message found" (a stream that exists, no matching message).
_NO_MESSAGE = 10037
# How often an idle consumer says so: the end of a read whose bound was deleted meanwhile.
_HEARTBEAT = 1.0
#: How long one read of a listing may take before it fails (10,000 keys take ~0.5 s).
READ_LIMIT = 30.0
_NS = 1_000_000_000
# Subjects rewritten behind the consumer: up to this many are read one by one, more are
# caught by reading on (at most this many rounds).
_FEW = 20
_ROUNDS = 5
# Headers that make a message a deletion: a key-value delete or purge, a server marker.
_DELETIONS = (b"KV-Operation: DEL", b"KV-Operation: PURGE", b"Nats-Marker-Reason:")


class IncompleteListing(MeshForgeError):
    """A listing could not be read to its end; what was read is not shown as the whole."""


@dataclass(frozen=True, slots=True)
class Entry:
    """The last message on one subject: ``deleted`` for a key-value delete or purge marker."""

    subject: str
    data: bytes
    seq: int
    deleted: bool = False


async def _api(js: JetStreamContext, api: str, request: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = await js._api_request(
        f"{js._prefix}.{api}", json.dumps(request).encode(), timeout=js._timeout
    )
    return answer


async def _last(js: JetStreamContext, stream: str, subjects: str) -> dict[str, Any] | None:
    try:
        answer = await _api(js, f"STREAM.MSG.GET.{stream}", {"last_by_subj": subjects})
    except NotFoundError as exc:
        if exc.err_code == _NO_MESSAGE:
            return None
        raise
    message: dict[str, Any] = answer["message"]
    return message


async def last_message(js: JetStreamContext, stream: str, subjects: str) -> tuple[int, str] | None:
    """The stream sequence and the time (RFC 3339) of the last message on ``subjects``
    (wildcards allowed); None when there is none. A missing stream raises nats-py's
    ``NotFoundError``."""
    found = await _last(js, stream, subjects)
    return (int(found["seq"]), str(found["time"])) if found else None


async def last_sequence(js: JetStreamContext, stream: str, subjects: str) -> int:
    """The stream sequence of the last message on ``subjects``; 0 when there is none."""
    last = await last_message(js, stream, subjects)
    return last[0] if last else 0


async def _stored_subjects(js: JetStreamContext, stream: str, subjects: str) -> set[str]:
    """Every subject matching ``subjects`` with a message stored now (the server pages them)."""
    names: set[str] = set()
    while True:
        info = await _api(
            js, f"STREAM.INFO.{stream}", {"subjects_filter": subjects, "offset": len(names)}
        )
        page = (info.get("state") or {}).get("subjects") or {}
        names.update(page)
        if not page or len(names) >= int(info.get("total") or 0):
            return names


def _position(reply: str) -> tuple[int, int]:
    """Stream and consumer sequence of a delivery, from its ack subject
    (``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>``, or the form
    with a domain and an account hash after ``ACK``)."""
    tokens = reply.split(".")
    base = 2 if len(tokens) == 9 else 4
    return int(tokens[base + 3]), int(tokens[base + 4])


class _Read:
    """An ephemeral consumer's deliveries, recorded as they come; ``until(seq)`` waits
    until it has passed ``seq`` (or fails on a gap)."""

    def __init__(self, js: JetStreamContext, stream: str, subjects: str) -> None:
        self.js, self.stream, self.subjects = js, stream, subjects
        self.found: dict[str, Entry] = {}
        self.seen = 0  # the highest stream sequence delivered
        self.expected = 1  # the next consumer sequence: a gap means a lost delivery
        self.upto = 0
        self.failure: Exception | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def until(self, upto: int) -> None:
        self.upto = upto
        self.done = asyncio.get_running_loop().create_future()
        self._check()
        try:
            await asyncio.wait_for(asyncio.shield(self.done), READ_LIMIT)
        except TimeoutError:
            raise IncompleteListing(
                f"listing {self.subjects} of {self.stream} did not finish within "
                f"{READ_LIMIT:g}s ({len(self.found)} subjects read, up to sequence "
                f"{self.seen} of {upto})"
            ) from None

    def _check(self) -> None:
        if self.done.done():
            return
        if self.failure is not None:
            self.done.set_exception(self.failure)
        elif self.seen >= self.upto:
            self.done.set_result(None)

    async def on_msg(self, msg: Msg) -> None:
        if self.failure is not None:
            return
        try:
            if msg.headers and msg.headers.get("Status") == "100":
                await self._control(msg)
            else:
                self._record(msg)
        except Exception as exc:  # the reader's failure, for the caller waiting on done
            self.failure = exc
        self._check()

    def _record(self, msg: Msg) -> None:
        seq, delivery = _position(msg.reply)
        if delivery != self.expected:
            raise IncompleteListing(
                f"listing {self.subjects} of {self.stream}: delivery {delivery} came "
                f"after {self.expected - 1}"
            )
        self.expected += 1
        self.seen = seq
        headers = msg.headers or {}
        deleted = headers.get("KV-Operation") in ("DEL", "PURGE") or (
            "Nats-Marker-Reason" in headers
        )
        self.found[msg.subject] = Entry(msg.subject, msg.data, seq, deleted)

    async def _control(self, msg: Msg) -> None:
        """Flow control and a stalled consumer get their answer; an idle heartbeat ends
        a wait whose bound was deleted meanwhile (nothing up to it is left to deliver)."""
        assert msg.headers is not None
        answer = msg.reply or msg.headers.get("Nats-Consumer-Stalled")
        if answer:
            await self.js._nc.publish(answer, b"")
        elif (
            not self.done.done()
            and self.seen < self.upto
            and await last_sequence(self.js, self.stream, self.subjects) <= self.seen
        ):
            self.upto = self.seen


@contextlib.asynccontextmanager
async def _consumer(js: JetStreamContext, stream: str, subjects: str) -> AsyncIterator[_Read]:
    """An ephemeral consumer delivering every stored message on ``subjects`` in order."""
    nc = js._nc
    inbox = nc.new_inbox()
    read = _Read(js, stream, subjects)
    sub = await nc.subscribe(inbox, cb=read.on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
    config = {
        "deliver_subject": inbox,
        "deliver_policy": "all",
        "filter_subject": subjects,
        "ack_policy": "none",
        "replay_policy": "instant",
        "flow_control": True,
        "idle_heartbeat": int(_HEARTBEAT * _NS),
        "inactive_threshold": int(READ_LIMIT * _NS),
        "mem_storage": True,
        "num_replicas": 1,
    }
    name = None
    try:
        created = await _api(
            js, f"CONSUMER.CREATE.{stream}", {"stream_name": stream, "config": config}
        )
        name = created["name"]
        yield read
    finally:
        await sub.unsubscribe()
        if name is not None:  # else it goes after inactive_threshold
            with contextlib.suppress(APIError, NatsTimeout, TimeoutError):
                await _api(js, f"CONSUMER.DELETE.{stream}.{name}", {})


async def _read_once(js: JetStreamContext, stream: str, subjects: str) -> dict[str, Entry]:
    upto = await last_sequence(js, stream, subjects)
    if upto == 0:
        return {}
    async with _consumer(js, stream, subjects) as read:
        await read.until(upto)
        for _ in range(_ROUNDS):
            stored = await _stored_subjects(js, stream, subjects)
            missing = stored - read.found.keys()
            if len(missing) <= _FEW:
                break
            # Rewritten after the consumer passed them: their new revisions come later.
            await read.until(await last_sequence(js, stream, subjects))
        found = dict(read.found)
    for subject in missing:  # the few rewritten while the others were read
        message = await _last(js, stream, subject)
        if message is not None:
            hdrs = base64.b64decode(message.get("hdrs") or "")
            data = base64.b64decode(message.get("data") or "")
            deleted = any(mark in hdrs for mark in _DELETIONS)
            found[subject] = Entry(subject, data, int(message["seq"]), deleted)
    return {subject: found[subject] for subject in found.keys() & stored}


async def read_latest(js: JetStreamContext, stream: str, subjects: str) -> dict[str, Entry]:
    """The last message of every subject of ``stream`` matching ``subjects``, by subject,
    delete markers included (see the module docstring). Tries twice, then raises
    ``IncompleteListing``."""
    for attempt in (1, 2):
        try:
            return await _read_once(js, stream, subjects)
        except IncompleteListing:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


async def read_bucket(js: JetStreamContext, bucket: str, keys: str = ">") -> dict[str, Entry]:
    """Every live key of the key-value ``bucket`` matching the subject pattern ``keys``,
    with its latest value (deleted and purged keys left out). A missing bucket raises
    nats-py's ``NotFoundError``."""
    prefix = f"$KV.{bucket}."
    entries = await read_latest(js, f"KV_{bucket}", prefix + keys)
    return {
        subject.removeprefix(prefix): entry
        for subject, entry in entries.items()
        if not entry.deleted
    }
