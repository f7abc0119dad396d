"""Listings that are never silently short: every key of a bucket, every subject of a stream.

nats-py's ``KeyValue.keys()`` and its watcher decide that the stored values are all
delivered from a consumer info taken *after* the consumer started delivering: when the
deliveries are already in, the info says nothing is pending and the listing ends early,
often empty (1-13% of listings of 1,000-3,000 keys). A listing that says "no nodes" when
there are thousands is worse than an error.

``read_latest`` takes the bound first: the sequence of the last message on the subjects
(one request; none at all means the listing is truly empty). Then an ephemeral consumer
delivers the last message of every subject, and the read ends only once it has seen that
sequence (or a later one) *and* the server says nothing more is pending, so a key
rewritten while it is read is still listed (with its new value). A read that cannot get
there in ``READ_LIMIT`` seconds, or that sees a gap in the consumer's sequence, raises
``IncompleteListing``: the caller says so instead of showing less.

Example::

    entries = await read_bucket(conn.js, "MESHFORGE_NODES", "plant3.>")
    for key, entry in sorted(entries.items()):
        print(key, entry.seq, entry.data)
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from meshforge.errors import MeshForgeError

__all__ = [
    "Entry",
    "IncompleteListing",
    "last_message",
    "last_sequence",
    "read_bucket",
    "read_latest",
]

# The server's error code for "no message found" (a stream that exists, no matching message).
_NO_MESSAGE = 10037
# How often an idle consumer says so: the fallback end of a read whose pending count drifted.
_HEARTBEAT = 1.0
#: How long one read of a listing may take before it fails (at 10,000 keys it takes ~0.1 s).
READ_LIMIT = 30.0
_NS = 1_000_000_000


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


async def last_message(js: JetStreamContext, stream: str, subjects: str) -> tuple[int, str] | None:
    """The stream sequence and the time (RFC 3339) of the last message on ``subjects``
    (wildcards allowed); None when there is none. A missing stream raises nats-py's
    ``NotFoundError``."""
    try:
        answer = await _api(js, f"STREAM.MSG.GET.{stream}", {"last_by_subj": subjects})
    except NotFoundError as exc:
        if exc.err_code == _NO_MESSAGE:
            return None
        raise
    return int(answer["message"]["seq"]), str(answer["message"]["time"])


async def last_sequence(js: JetStreamContext, stream: str, subjects: str) -> int:
    """The stream sequence of the last message on ``subjects``; 0 when there is none."""
    last = await last_message(js, stream, subjects)
    return last[0] if last else 0


def _deleted(msg: Msg) -> bool:
    headers = msg.headers or {}
    return headers.get("KV-Operation") in ("DEL", "PURGE") or "Nats-Marker-Reason" in headers


async def read_latest(js: JetStreamContext, stream: str, subjects: str) -> dict[str, Entry]:
    """The last message of every subject of ``stream`` matching ``subjects``, by subject,
    delete markers included (see the module docstring). Tries twice, then raises
    ``IncompleteListing``."""
    for attempt in (1, 2):
        try:
            return await _read_once(js, stream, subjects, time.monotonic() + READ_LIMIT)
        except IncompleteListing:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


async def _read_once(
    js: JetStreamContext, stream: str, subjects: str, deadline: float
) -> dict[str, Entry]:
    upto = await last_sequence(js, stream, subjects)
    if upto == 0:
        return {}
    nc = js._nc
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, pending_msgs_limit=-1, pending_bytes_limit=-1)
    config = {
        "deliver_subject": inbox,
        "deliver_policy": "last_per_subject",
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
    found: dict[str, Entry] = {}
    try:
        created = await _api(
            js, f"CONSUMER.CREATE.{stream}", {"stream_name": stream, "config": config}
        )
        name = created["name"]
        seen = 0  # the highest stream sequence delivered
        expected = 1  # the next consumer sequence: a gap means a lost delivery
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise IncompleteListing(
                    f"listing {subjects} of {stream} did not finish within {READ_LIMIT:g}s "
                    f"({len(found)} subjects read, up to sequence {seen} of {upto})"
                )
            try:
                msg = await sub.next_msg(timeout=left)
            except (TimeoutError, NatsTimeout):
                continue
            headers = msg.headers or {}
            if headers.get("Status") == "100":  # flow control or an idle heartbeat
                answer = msg.reply or headers.get("Nats-Consumer-Stalled")
                if answer:
                    await nc.publish(answer, b"")
                elif seen >= upto or await last_sequence(js, stream, subjects) <= seen:
                    return found  # idle with nothing left: a pending count that drifted
                continue
            meta = msg.metadata
            if meta.sequence.consumer != expected:
                raise IncompleteListing(
                    f"listing {subjects} of {stream}: delivery {meta.sequence.consumer} "
                    f"came after {expected - 1}"
                )
            expected += 1
            seen = max(seen, meta.sequence.stream)
            found[msg.subject] = Entry(msg.subject, msg.data, meta.sequence.stream, _deleted(msg))
            if seen >= upto and meta.num_pending == 0:
                return found
    finally:
        await sub.unsubscribe()
        if name is not None:  # else it goes after inactive_threshold
            with contextlib.suppress(APIError, NatsTimeout, TimeoutError):
                await _api(js, f"CONSUMER.DELETE.{stream}.{name}", {})


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
