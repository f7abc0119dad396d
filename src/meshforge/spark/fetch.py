"""Reading a contiguous range of stream sequences, chunk by chunk, as plain columns.

Two ways, chosen by the stream's retention:

* limits streams: an ephemeral pull consumer with no acks, in memory, starting at the
  range's first sequence, pulled in large batches. Sequence, stored time and pending
  count come from the reply subject, so no per-message metadata object is built.
* work-queue and interest streams: a consumer there would take messages away from
  their workers, so messages are fetched by sequence (``STREAM.MSG.GET``), which
  leaves the stream untouched.

Deleted messages (gaps) are skipped by both. A broken pull (lost connection, dropped
message) resumes from the sequence after the last one kept, so nothing is read twice.

Example::

    with SyncNats(conn) as client:
        for chunk in read_range(client, "MESHFORGE_EVENTS", 1, 1000, retention="limits"):
            print(len(chunk))
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from meshforge.errors import ConnectionFailed
from meshforge.spark.nats_sync import JetStreamApiError, SyncNats
from meshforge.transport.headers import parse_header_block, text_headers

__all__ = ["Chunk", "read_range"]

DEFAULT_BATCH = 10_000
_CHUNK_BYTES = 32 * 1024 * 1024  # at most this much is pulled per request
_STALL_TIMEOUT = 30.0
_ATTEMPTS = 5
_GET_WINDOW = 256


@dataclass(slots=True)
class Chunk:
    """Messages in sequence order, as parallel lists."""

    subjects: list[str] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    ts_ns: list[int] = field(default_factory=list)
    headers: list[dict[str, str] | None] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


def read_range(
    client: SyncNats,
    stream: str,
    first: int,
    last: int,
    *,
    retention: str = "limits",
    filter_subject: str | None = None,
    batch: int = DEFAULT_BATCH,
    avg_size: int = 0,
) -> Iterator[Chunk]:
    """Yield the stored messages with ``first <= seq <= last``, in order, in chunks."""
    if last < first:
        return
    if retention == "limits":
        if avg_size > 0:
            batch = max(100, min(batch, _CHUNK_BYTES // max(avg_size, 1)))
        yield from _consumer_range(client, stream, first, last, filter_subject, batch)
    else:
        yield from _get_range(client, stream, first, last, filter_subject)


# --- limits streams: an ephemeral ordered pull --------------------------------------


class _Pull:
    """One ephemeral consumer and its inbox; collects one pull request at a time."""

    def __init__(
        self,
        client: SyncNats,
        stream: str,
        start: int,
        last: int,
        filter_subject: str | None,
        batch: int,
    ) -> None:
        self.client = client
        self.stream = stream
        self.last = last
        self.filter_subject = filter_subject
        self.batch = batch
        self.start = start
        self.name = f"mfspark_{uuid.uuid4().hex[:16]}"
        self.chunk = Chunk()
        self.got = 0
        self.done = False  # nothing more to read in the range
        self.broken: str | None = None
        self.expected_dseq = 1
        self.event = asyncio.Event()
        self.sub: Subscription | None = None
        self.inbox = ""

    async def open(self) -> None:
        nc = self.client.nc
        self.inbox = nc.new_inbox()
        # unbounded pending queue: the pull batch already bounds what is in flight
        self.sub = await nc.subscribe(
            self.inbox, cb=self._on_msg, pending_msgs_limit=0, pending_bytes_limit=0
        )
        config: dict[str, object] = {
            "name": self.name,
            "deliver_policy": "by_start_sequence",
            "opt_start_seq": self.start,
            "ack_policy": "none",
            "replay_policy": "instant",
            "mem_storage": True,
            "num_replicas": 1,
            "inactive_threshold": 60_000_000_000,
            "max_waiting": 4,
        }
        if self.filter_subject:
            config["filter_subject"] = self.filter_subject
        await self.client.api(
            f"$JS.API.CONSUMER.CREATE.{self.stream}.{self.name}",
            {"stream_name": self.stream, "config": config},
        )

    async def _on_msg(self, msg: Msg) -> None:
        if self.done or self.broken:
            return
        reply = msg.reply
        if not reply:
            status = (msg.headers or {}).get("Status", "")
            if status in ("404", "408"):
                self.done = True  # nothing more available now
            else:
                desc = (msg.headers or {}).get("Description", "")
                self.broken = f"pull ended with status {status} {desc}".strip()
            self.event.set()
            return
        tokens = reply.split(".")
        # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending> (v1, 9 tokens)
        # $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>.<r> (v2)
        base = 2 if len(tokens) == 9 else 4
        sseq = int(tokens[base + 3])
        dseq = int(tokens[base + 4])
        if dseq != self.expected_dseq:
            self.broken = f"delivery {dseq} arrived where {self.expected_dseq} was due"
            self.event.set()
            return
        self.expected_dseq = dseq + 1
        if sseq > self.last:
            self.done = True
            self.event.set()
            return
        chunk = self.chunk
        chunk.subjects.append(msg.subject)
        chunk.seqs.append(sseq)
        chunk.ts_ns.append(int(tokens[base + 5]))
        chunk.headers.append(text_headers(msg.headers) or None)
        chunk.data.append(msg.data)
        self.got += 1
        if sseq >= self.last or tokens[base + 6] == "0":
            self.done = True
            self.event.set()
        elif self.got >= self.batch:
            self.event.set()

    async def pull(self) -> Chunk:
        """Send one pull request and wait for its messages (or the range's end)."""
        self.chunk, self.got = Chunk(), 0
        self.event.clear()
        request = {"batch": self.batch, "no_wait": True}
        await self.client.nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.name}",
            json.dumps(request).encode(),
            reply=self.inbox,
        )
        try:
            await asyncio.wait_for(self.event.wait(), _STALL_TIMEOUT)
        except TimeoutError:
            self.broken = f"no answer to a pull within {_STALL_TIMEOUT:.0f}s"
        return self.chunk

    async def close(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):  # the connection may already be gone
                await self.sub.unsubscribe()
        with contextlib.suppress(Exception):  # it expires by itself after inactive_threshold
            await self.client.api(f"$JS.API.CONSUMER.DELETE.{self.stream}.{self.name}", wait=2.0)


def _consumer_range(
    client: SyncNats, stream: str, first: int, last: int, filter_subject: str | None, batch: int
) -> Iterator[Chunk]:
    start, failures = first, 0
    while start <= last:
        pull = _Pull(client, stream, start, last, filter_subject, batch)
        try:
            client.run(pull.open())
            while True:
                chunk = client.run(pull.pull())
                if pull.broken:
                    # keep only what precedes the break: the next pull resumes after it
                    raise ConnectionFailed(pull.broken)
                if chunk.seqs:
                    start = chunk.seqs[-1] + 1
                    failures = 0
                    yield chunk
                if pull.done:
                    return
        except (ConnectionFailed, OSError) as exc:
            failures += 1
            if failures >= _ATTEMPTS:
                raise ConnectionFailed(
                    f"reading {stream} from seq {start}: {exc} ({failures} attempts)"
                ) from None
        finally:
            if client.connected:
                client.run(pull.close())
        if not client.connected:
            client.reconnect()


# --- work-queue / interest streams: non-destructive gets ------------------------------


def _ts_ns(text: str) -> int:
    """RFC 3339 with nanoseconds to integer nanoseconds since the epoch."""
    body = text.rstrip("Z")
    frac = "0"
    if "." in body:
        body, frac = body.split(".", 1)
    secs = int(datetime.fromisoformat(body + "+00:00").timestamp())
    return secs * 1_000_000_000 + int(frac[:9].ljust(9, "0"))


def _add(chunk: Chunk, message: dict[str, object]) -> None:
    chunk.subjects.append(str(message["subject"]))
    chunk.seqs.append(int(str(message["seq"])))
    chunk.ts_ns.append(_ts_ns(str(message["time"])))
    hdrs = message.get("hdrs")
    chunk.headers.append(parse_header_block(base64.b64decode(str(hdrs))) if hdrs else None)
    data = message.get("data")
    chunk.data.append(base64.b64decode(str(data)) if data else b"")


async def _get(
    client: SyncNats, stream: str, request: dict[str, object]
) -> dict[str, object] | None:
    try:
        answer = await client.api(f"$JS.API.STREAM.MSG.GET.{stream}", request)
    except JetStreamApiError as exc:
        if exc.code == 404:
            return None  # deleted, or nothing at or after this sequence
        raise
    message = answer.get("message")
    return message if isinstance(message, dict) else None


def _get_range(
    client: SyncNats, stream: str, first: int, last: int, filter_subject: str | None
) -> Iterator[Chunk]:
    seq = first
    while seq <= last:
        chunk = Chunk()
        if filter_subject:
            # the server skips to the next match; one request per kept message
            while seq <= last and len(chunk) < _GET_WINDOW:
                message = client.run(
                    _get(client, stream, {"seq": seq, "next_by_subj": filter_subject})
                )
                if message is None or int(str(message["seq"])) > last:
                    seq = last + 1
                    break
                _add(chunk, message)
                seq = chunk.seqs[-1] + 1
        else:
            window = list(range(seq, min(seq + _GET_WINDOW, last + 1)))

            async def fetch_all(seqs: list[int]) -> list[dict[str, object] | None]:
                return list(await asyncio.gather(*(_get(client, stream, {"seq": s}) for s in seqs)))

            for message in client.run(fetch_all(window)):
                if message is not None:
                    _add(chunk, message)
            seq = window[-1] + 1
        if len(chunk):
            yield chunk
