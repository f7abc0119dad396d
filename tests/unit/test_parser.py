"""The client's quicker protocol parser hands on the very messages and protocol lines
nats-py's own parser does, however the bytes are split across reads."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.protocol.parser import Parser

from meshforge.transport.connection import _Client, _Parser


def hmsg(head: bytes, hdr: bytes, body: bytes) -> bytes:
    return b"HMSG %s %d %d\r\n%s%s\r\n" % (head, len(hdr), len(hdr) + len(body), hdr, body)


_OPS = [
    b"MSG a.b 1 5\r\nhello\r\n",
    b"MSG a.b 22 _INBOX.x.7 2\r\nhi\r\n",
    b"MSG a.b 3 0\r\n\r\n",
    hmsg(b"a.b 2 $JS.ACK.S.c.1.2.2.1764157466664076000.0", b"NATS/1.0\r\nA: b\r\n\r\n", b"body"),
    hmsg(b"a.b 2", b"NATS/1.0\r\n\r\n", b""),
    hmsg(b"_INBOX.p.1 2", b"NATS/1.0 100\r\n\r\n", b""),
    hmsg(b"_INBOX.p.1 2", b"NATS/1.0 404 No Messages\r\n\r\n", b""),
    b"PING\r\n",
    b"PONG\r\n",
    b"+OK\r\n",
    b'INFO {"server_id":"x","max_payload":1048576}\r\n',
    b"-ERR 'Unknown Protocol Operation'\r\n",
]


class Recorder:
    """Stands in for the client: notes every call a parser makes."""

    def __init__(self, direct: bool) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.direct = direct

    def _deliver_now(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, hdr: bytes | None
    ) -> bool:
        if self.direct and sid == 2:
            self.events.append(("msg", sid, bytes(subject), bytes(reply), data, hdr))
            return True
        return False

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, hdr: bytes | None
    ) -> None:
        self.events.append(("msg", sid, bytes(subject), bytes(reply), data, hdr))

    async def _process_ping(self) -> None:
        self.events.append(("ping",))

    async def _process_pong(self) -> None:
        self.events.append(("pong",))

    async def _process_info(self, info: dict[str, Any]) -> None:
        self.events.append(("info", info))

    async def _process_err(self, err: str) -> None:
        self.events.append(("err", err))


def feed(parser: Parser, chunks: list[bytes]) -> None:
    async def run() -> None:
        for chunk in chunks:
            await parser.parse(chunk)

    asyncio.run(run())


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(_OPS), min_size=1, max_size=12),
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
    st.booleans(),
)
def test_same_calls_as_nats_py_for_any_split(
    ops: list[bytes], cuts: list[int], direct: bool
) -> None:
    data = b"".join(ops)
    ours, theirs = Recorder(direct), Recorder(direct)
    quick, reference = _Parser(ours), Parser(theirs)
    feed(quick, split(data, cuts))
    feed(reference, split(data, cuts))
    assert ours.events == theirs.events
    assert bytes(quick.buf) == bytes(reference.buf) == b""
    assert quick.state == reference.state


def test_a_partial_line_waits_for_the_rest() -> None:
    rec = Recorder(direct=False)
    parser = _Parser(rec)
    feed(parser, [b"MSG a.b 1 5\r\nhel", b"lo\r\nPI"])
    assert rec.events == [("msg", 1, b"a.b", b"", b"hello", None)]
    feed(parser, [b"NG\r\n"])
    assert rec.events[-1] == ("ping",)


_BLOCK_PIECES = st.sampled_from(
    [b"NATS/1.0", b"NATS/1.0\r\n", b"NATS/1.0 100", b" 404 No Messages", b"\r\n", b"A: b", b"Bad Name: x",
     b"Nats-Msg-Id:m-1", b":", b" ", b"\xff"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(_BLOCK_PIECES, min_size=1, max_size=8))
def test_direct_delivery_reads_headers_as_nats_py_does(pieces: list[bytes]) -> None:
    block = b"".join(pieces)
    nc = _Client()
    nc._subs[2] = object()  # type: ignore[assignment]
    got: list[Any] = []
    nc.deliver_direct(2, got.append)
    if len(block) <= 8 or block[8:9] == b" ":  # a status (or no header line): nats-py's way
        assert not nc._deliver_now(2, b"a.b", b"", b"x", block)
        return
    assert nc._deliver_now(2, b"a.b", b"r", b"x", block)
    assert got[0].headers == asyncio.run(nc._process_headers(block))
    assert got[0].data == b"x" and got[0].reply == "r" and got[0].subject == "a.b"
