"""Any header a producer can put on the wire, through a real server, the router and every
dead-letter reader: nothing raises, and nothing reaches a terminal or a page unescaped.

Headers are sent as raw ``HPUB`` bytes (invalid UTF-8 included, which nats-py cannot
send), values and bodies up to the server's limits. ``MESHFORGE_FUZZ_EXAMPLES`` sets the
number of examples (``make chaos``: more).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from console_client import Browser
from dlq_support import take
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.cli.events import render
from meshforge.config import load_settings
from meshforge.console.app import create_app
from meshforge.console.auth import ConsoleTokens
from meshforge.deadletters.admin import DeadLetters
from meshforge.deadletters.route import dead_letter
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_FAILED
from meshforge.transport.connection import Connection, connect
from meshforge.transport.headers import RESERVED
from meshforge.transport.server import EmbeddedServer

EXAMPLES = int(os.environ.get("MESHFORGE_FUZZ_EXAMPLES", "25"))
VIEWER = "viewer-" + uuid.uuid4().hex
SUBJECT = "cmd.acme.demo.order.create"
# What a header name may hold on the wire: printable ASCII, no ':' and no space.
_NAME_CHARS = "".join(chr(c) for c in range(33, 127) if chr(c) != ":")
_names = st.sampled_from(RESERVED) | st.text(_NAME_CHARS, min_size=1, max_size=30).filter(
    lambda n: not n.lower().startswith("nats") and n.lower() != "status"
)
# A value is any bytes but CR and LF: UTF-8 text, invalid UTF-8, controls, near 64 KiB.
_bytes = st.binary(max_size=64).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_unicode = st.text(max_size=40).map(
    lambda t: t.encode("utf-8", "surrogatepass").replace(b"\r", b"").replace(b"\n", b"")
)
_long = st.integers(1_000, 60_000).map(lambda n: "é".encode() * (n // 2) + b"\xff")
_values = _bytes | _unicode | _long
_headers = st.lists(st.tuples(_names, _values), max_size=6)
_bodies = st.binary(max_size=512) | st.integers(1, 300_000).map(lambda n: b"\xc3\xa9\x00" * n)


@pytest.fixture
async def rig(private_server: EmbeddedServer) -> AsyncIterator[tuple[str, Connection]]:
    settings_ = load_settings({"nats_url": private_server.url}, env={})
    conn = await connect(settings_, name="fuzz-dlq-headers")
    await ensure(conn.js, default_streams(settings_), [])
    yield private_server.url, conn
    await conn.close()


JETSTREAM_MAX_HEADERS = 65_535  # "header size exceeds maximum allowed of 64k" past it


def header_block(headers: list[tuple[str, bytes]]) -> bytes:
    """The ``NATS/1.0`` header block of an ``HPUB``, as sent on the wire."""
    lines = b"".join(n.encode() + b": " + v + b"\r\n" for n, v in headers)
    return b"NATS/1.0\r\n" + lines + b"\r\n"


async def raw_publish(
    url: str, subject: str, headers: list[tuple[str, bytes]], body: bytes
) -> None:
    """``HPUB`` as bytes on the wire: the one way to send a header nats-py would refuse."""
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await reader.readline()  # INFO
        block = header_block(headers)
        connect_ = {"verbose": False, "pedantic": False, "headers": True}
        writer.write(f"CONNECT {json.dumps(connect_)}\r\n".encode())
        writer.write(f"HPUB {subject} {len(block)} {len(block) + len(body)}\r\n".encode())
        writer.write(block + body + b"\r\nPING\r\n")
        await writer.drain()
        line = await reader.readline()
        assert line == b"PONG\r\n", line
    finally:
        writer.close()
        await writer.wait_closed()


def escaped(text: str) -> bool:
    """No character that drives a terminal: every one printable, or a line break or tab."""
    return all(c.isprintable() or c in "\n\t" for c in text)


def cli(*args: str) -> str:
    result = CliRunner(env={"COLUMNS": "160"}).invoke(app, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return result.output


async def page(app_: Any, path: str, query: str = "") -> str:
    answer = await Browser(app_).get(path, query, authorization=f"Bearer {VIEWER}")
    assert answer.raised is None and answer.status == 200, answer.text[:300]
    return answer.body.decode()  # strict: the page is valid UTF-8


# No shrinking: each example costs a round trip through the server and the tools.
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
@given(headers=_headers, body=_bodies)
async def test_any_header_and_body_pass_the_router_and_every_reader(
    rig: tuple[str, Connection], headers: list[tuple[str, bytes]], body: bytes
) -> None:
    url, conn = rig
    for stream in (STREAM_COMMANDS, STREAM_FAILED):  # one failed example leaves nothing behind
        await conn.js.purge_stream(stream)
    settings_ = load_settings({"nats_url": url, "tenant": "acme"}, env={})
    pub = Publisher(conn.js, settings_, Metrics())
    # JetStream stores no message whose header block passes 64 KiB (it is dropped unstored):
    # the headers are cut to that limit, which the values near 64 KiB then test.
    while len(header_block(headers)) > JETSTREAM_MAX_HEADERS:
        headers = headers[:-1]
    room = pub.limits().max_payload - len(header_block(headers)) - 64
    body = body[: max(0, room)]
    await raw_publish(url, SUBJECT, headers, body)
    msg = await take(conn.js, SUBJECT)
    assert escaped(render(msg, as_json=True)) and escaped(render(msg, as_json=False))

    result = await dead_letter(pub, msg, reason="malformed", error="fuzz", consumer="fuzz")
    letters = DeadLetters(conn.js, pub)
    letter = await letters.get(result.seq)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in letter.headers.items())
    assert letter.reason == "malformed" and letter.stream == STREAM_COMMANDS
    for name in letter.headers:
        if name.lower().startswith("dlq-"):
            assert name in RESERVED, f"a producer's {name} reached the letter as the router's"
    whole = await letters.original(letter)
    assert whole.data == body

    assert escaped(await asyncio.to_thread(cli, "dlq", "ls", "--nats-url", url))
    listed = await asyncio.to_thread(cli, "dlq", "ls", "--json", "--nats-url", url)
    assert listed.isascii() and json.loads(listed)[0]["id"] == result.seq
    shown = await asyncio.to_thread(cli, "dlq", "show", str(result.seq), "--nats-url", url)
    assert escaped(shown)
    if letter.truncated:
        args = ("dlq", "show", str(result.seq), "--original", "--nats-url", url)
        assert escaped(await asyncio.to_thread(cli, *args))

    console = create_app(settings_, nats_url=url, tokens=ConsoleTokens(viewer=VIEWER))
    console.state.console.conn = conn
    for path, query in (("/dead-letters", ""), (f"/dead-letters/{result.seq}", "original=1")):
        html = await page(console, path, query)
        assert escaped(html.replace("\r", ""))

    await letters.redrive(result.seq)
    await take(conn.js, SUBJECT)  # the re-driven command, acked: the next example starts empty
    assert await letters.count() == 0
    info = await conn.js.stream_info(STREAM_FAILED)
    assert info.state.messages == 0, "a re-drive left a kept original behind"
