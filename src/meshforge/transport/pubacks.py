"""A lean JetStream publish path: a window of messages in one write, one shared reply
subject, PubAcks resolved straight from the connection's read loop.

nats-py's ``publish_async`` pays, for every message, a semaphore wait, a random token, a
future with a done callback, a hop through a subscription queue and a task wake-up for
its PubAck, and a dataclass built field by field from the reply. ``PubAckPipe`` sends each
window of messages as one buffer and files each PubAck into the caller's list by a
counter token; MeshForge's client class (``meshforge.transport.connection``) hands it the replies
before nats-py would build a message for them. The answers are nats-py's own types (a
``PubAck``, or the error nats-py would raise), so callers classify them as before; a
message whose headers and body together exceed ``max_payload`` is refused with nats-py's
``MaxPayloadError`` too (nats-py would send it, and the server drop the connection).

Example (what ``Publisher.publish_many`` does on a MeshForge connection)::

    pipe = nc.pubacks()
    answers = await pipe.publish(items, max_in_flight=256, answer_within=5.0)
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import nats.errors
import nats.js.errors
from nats.js.api import PubAck

__all__ = ["Message", "PubAckPipe", "encode_headers"]

Answer = PubAck | BaseException


class Message(Protocol):
    """What ``publish_many`` sends: an ``Outbound``, or anything with its four fields
    (the engine hands over its stored outputs as they are)."""

    @property
    def subject(self) -> str: ...
    @property
    def data(self) -> bytes: ...
    @property
    def headers(self) -> dict[str, str]: ...
    @property
    def msg_id(self) -> str: ...


# The same rules nats-py applies to header names and values when it sends them.
_KEY_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token, as nats-py checks
_VALUE_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
_known_keys: dict[str, bool] = {}
_good_keys: set[str] = set()  # the names in _known_keys that are good
_OTHER_SPACES = "\t\x0b\x0c\x1c\x1d\x1e\x1f"  # ASCII whitespace str.strip() removes, but ' \r\n'
_STATUS_AT = len(b"NATS/1.0 ")


def encode_headers(headers: Mapping[str, str]) -> bytes:
    """The NATS header block for ``headers``, exactly as nats-py writes it (names checked,
    values stripped, line breaks in values made spaces)."""
    text = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
    n = len(headers)
    # The common case in one pass: known good names, nothing to strip, no line breaks.
    if (
        text.isascii()
        and text.count("\n") == n
        and text.count("\r") == n
        and ":  " not in text
        and " \r" not in text
        and not any([c in text for c in _OTHER_SPACES])
        and _good_keys.issuperset(headers)
    ):
        return b"NATS/1.0\r\n" + text.encode() + b"\r\n"
    lines = ["NATS/1.0\r\n"]
    for k, v in headers.items():
        key = k.strip()
        if not key:
            continue
        ok = _known_keys.get(key)
        if ok is None:
            ok = bool(_KEY_RE.fullmatch(key))
            if len(_known_keys) < 1024:
                _known_keys[key] = ok
                if ok:
                    _good_keys.add(key)
        if not ok:
            raise nats.errors.BadHeaderError(key)
        lines.append(f"{key}: {v.strip().translate(_VALUE_NEWLINES)}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode()


# A PubAck as the server writes it, stored or duplicate; anything else is read as JSON.
_PLAIN_ACK = re.compile(
    rb'\{"stream":"([!#-\[\]-~]+)","seq":(0|[1-9][0-9]*)(,"duplicate": ?true)?\}'
)


def _answer(data: bytes, headers: bytes | None) -> Answer:
    """A PubAck, or the error nats-py's ``publish_async`` would have set."""
    if headers and headers[_STATUS_AT : _STATUS_AT + 3] == b"503":
        return nats.js.errors.NoStreamResponseError()
    plain = _PLAIN_ACK.fullmatch(data)
    if plain is not None:
        stream, seq, duplicate = plain.groups()
        return PubAck(stream=stream.decode(), seq=int(seq), duplicate=True if duplicate else None)
    try:
        resp = json.loads(data)
        if "error" in resp:
            nats.js.errors.APIError.from_error(resp["error"])  # raises the matching type
        return PubAck(
            stream=resp["stream"], seq=resp["seq"], domain=resp.get("domain"),
            duplicate=resp.get("duplicate"),
        )  # fmt: skip
    except nats.js.errors.APIError as err:
        return err
    except (ValueError, TypeError, KeyError) as exc:
        return nats.errors.Error(f"nats: unreadable PubAck: {exc}")


class _Call:
    """The answers of one ``publish`` call, and a waiter woken as they come."""

    __slots__ = ("answers", "open", "waiter", "wake_at")

    def __init__(self, n: int) -> None:
        self.answers: list[Answer | None] = [None] * n
        self.open = 0  # sent, not answered
        self.waiter: asyncio.Future[None] | None = None
        self.wake_at = 0

    def settle(self, index: int, answer: Answer) -> None:
        if self.answers[index] is not None:
            return
        self.answers[index] = answer
        self.open -= 1
        waiter = self.waiter
        if waiter is not None and self.open <= self.wake_at and not waiter.done():
            waiter.set_result(None)


class PubAckPipe:
    """Pipelined JetStream publishes on one MeshForge client (``meshforge.transport.connection``,
    whose ``send_now`` writes and whose read loop calls ``on_reply``)."""

    def __init__(self, nc: Any) -> None:
        self._nc = nc
        self.sid: int | None = None
        self._prefix = b""
        self._open: dict[bytes, tuple[_Call, int]] = {}
        self._next = 0
        self._starting: asyncio.Lock | None = None

    async def _start(self) -> None:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.sid is not None:
                return
            nc = self._nc
            prefix = nc._inbox_prefix.decode() + "." + nc._nuid.next().decode() + "."
            sub = await nc.subscribe(prefix + "*")
            self._prefix = prefix.encode()
            self.sid = sub._id

    @property
    def pending(self) -> int:
        """Messages sent whose PubAck has not come yet."""
        return len(self._open)

    def on_reply(self, subject: bytes, data: bytes, headers: bytes | None) -> None:
        """A reply on the pipe's subject (called from the connection's read loop)."""
        entry = self._open.pop(bytes(subject[len(self._prefix) :]), None)
        if entry is not None:
            call, index = entry
            call.settle(index, _answer(data, headers))

    async def publish(
        self, items: Sequence[Message], *, max_in_flight: int, answer_within: float
    ) -> list[Answer]:
        """Send every item in order, at most ``max_in_flight`` PubAcks outstanding; one
        answer per item. A PubAck not back ``answer_within`` seconds after its message left
        is a ``nats.errors.TimeoutError``."""
        if self.sid is None:
            try:
                await self._start()
            except nats.errors.Error as exc:  # closed, draining: every message refused
                return [exc] * len(items)
        call = _Call(len(items))
        chunks: list[tuple[float, list[bytes]]] = []  # (sent at, tokens), oldest first
        try:
            start = 0
            while start < len(items):
                room = max_in_flight - call.open
                if room <= 0:
                    await self._wait(call, chunks, max_in_flight // 2, answer_within)
                    continue
                end = min(len(items), start + room)
                tokens, blob = self._encode(call, items, start, end)
                chunks.append((time.monotonic(), tokens))
                start = end
                if blob:  # the flusher writes this window while the next one is built
                    await self._nc.send_now(blob)
            while call.open > 0:
                await self._wait(call, chunks, 0, answer_within)
        finally:
            self._forget(call, chunks, None)
        return [a if a is not None else nats.errors.TimeoutError() for a in call.answers]

    def _encode(
        self, call: _Call, items: Sequence[Message], start: int, end: int
    ) -> tuple[list[bytes], bytes]:
        """The reply tokens and the HPUB commands of items ``start`` to ``end``; an item
        refused before sending gets its answer at once."""
        nc = self._nc
        refused = self._refused(nc)
        if refused is not None:
            for index in range(start, end):
                call.answers[index] = refused
            return [], b""
        prefix = self._prefix
        max_payload = nc._max_payload
        tokens: list[bytes] = []
        parts: list[bytes] = []
        size = 0
        for index in range(start, end):
            item = items[index]
            try:
                hdr = encode_headers(item.headers)
            except nats.errors.Error as exc:
                call.answers[index] = exc
                continue
            data = item.data
            # Over max_payload (headers count too) the server would drop the connection.
            if len(hdr) + len(data) > max_payload:
                call.answers[index] = nats.errors.MaxPayloadError()
                continue
            token = b"%d" % self._next
            self._next += 1
            parts.append(b"HPUB %s %s%s %d %d\r\n%s%s\r\n" % (
                item.subject.encode(), prefix, token, len(hdr), len(hdr) + len(data), hdr, data,
            ))  # fmt: skip
            size += len(data)
            tokens.append(token)
            self._open[token] = (call, index)
        call.open += len(tokens)
        nc.stats["out_msgs"] += len(parts)
        nc.stats["out_bytes"] += size
        return tokens, b"".join(parts)

    @staticmethod
    def _refused(nc: Any) -> BaseException | None:
        """What nats-py's ``publish`` would raise now for any message, if anything."""
        if nc.is_closed:
            return nats.errors.ConnectionClosedError()
        if nc.is_draining_pubs:
            return nats.errors.ConnectionDrainingError()
        if not nc.is_connected and (
            nc._max_pending_size <= 0 or nc._pending_data_size > nc._max_pending_size
        ):
            return nats.errors.OutboundBufferLimitError()
        return None

    async def _wait(
        self,
        call: _Call,
        chunks: list[tuple[float, list[bytes]]],
        open_at_most: int,
        answer_within: float,
    ) -> None:
        """Until at most ``open_at_most`` answers are missing, or the oldest open message's
        time is up (its answers, and those of messages as old, become timeouts)."""
        if call.open <= open_at_most:
            return
        oldest = next(sent for sent, tokens in chunks if any(t in self._open for t in tokens))
        call.wake_at = open_at_most
        call.waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(call.waiter, max(0.0, oldest + answer_within - time.monotonic()))
        except TimeoutError:
            self._forget(call, chunks, time.monotonic() - answer_within)
        finally:
            call.waiter = None

    def _forget(
        self, call: _Call, chunks: list[tuple[float, list[bytes]]], sent_before: float | None
    ) -> None:
        """Time out the open messages sent before ``sent_before`` (all when None)."""
        for sent, tokens in chunks:
            if not call.open or (sent_before is not None and sent > sent_before):
                return
            for token in tokens:
                entry = self._open.pop(token, None)
                if entry is not None:
                    call.settle(entry[1], nats.errors.TimeoutError())
