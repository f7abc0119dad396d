"""Sizes and bounded dead-letter tooling on a real server: refusing what cannot fit,
truncated dead letters with their originals kept, `dlq show` of any body."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from dlq_support import take
from nats.js import JetStreamContext
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.config import Settings, load_settings
from meshforge.deadletters.admin import DeadLetters
from meshforge.deadletters.route import H_DLQ_REASON, H_DLQ_TRUNCATED, dead_letter
from meshforge.envelope import H_MSG_ID
from meshforge.errors import MeshForgeError, PublishError
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_FAILED
from meshforge.transport.connection import connect
from meshforge.transport.sizes import header_size


def settings() -> Settings:
    return load_settings({}, env={})


@pytest.fixture
async def agent(js: JetStreamContext) -> AsyncIterator[str]:
    """A command agent name of this test alone; its messages are purged after."""
    await ensure(js, default_streams(settings()), [])
    name = f"big{uuid.uuid4().hex[:8]}"
    yield name
    await js.purge_stream(STREAM_COMMANDS, subject=f"cmd.default.demo.{name}.>")
    await js.purge_stream(STREAM_FAILED, subject=f"failed.cmd.default.demo.{name}.>")
    await js.purge_stream(STREAM_FAILED, subject=f"failed.original.{STREAM_COMMANDS}.>")


async def test_an_ordinary_publish_that_cannot_fit_is_refused_before_it_is_sent(
    js: JetStreamContext, agent: str
) -> None:
    async with await connect(settings(), url=js._nc.connected_url.geturl()) as conn:  # type: ignore[union-attr]
        pub = Publisher(conn.js, settings(), Metrics())
        limit = pub.limits().max_payload
        subject = f"cmd.default.demo.{agent}.create"
        # The body alone is under max_payload; with its headers it is over (nats-py only
        # counts the body and would send it, and the server would close the connection).
        with pytest.raises(PublishError) as info:
            await pub.publish(subject, b"x" * (limit - 20), headers={"X-Note": "y" * 100})
        text = str(info.value)
        assert info.value.kind == "payload_too_large" and "\n" not in text
        assert subject in text and f"max_payload of {limit} bytes" in text
        with pytest.raises(PublishError, match="header limit of 65535 bytes"):
            await pub.publish(subject, b"{}", headers={"X-Big": "y" * 70_000})
        assert conn.nc.is_connected and conn.state == "connected"
        assert (await pub.publish(subject, b"{}")).stream == STREAM_COMMANDS


async def test_a_dead_letter_over_max_payload_is_truncated_and_its_original_kept(
    js: JetStreamContext, agent: str, tmp_path: Path
) -> None:
    pub = Publisher(js, settings(), Metrics())
    limit = pub.limits().max_payload
    subject = f"cmd.default.demo.{agent}.create"
    body = bytes(range(256)) * ((limit - 100) // 256) + b"!" * ((limit - 100) % 256)
    assert len(body) == limit - 100
    await pub.publish(subject, body, msg_id=f"{agent}-big")
    msg = await take(js, subject)  # acked: gone from the work queue

    result = await dead_letter(pub, msg, reason="malformed", error="not JSON", consumer="c")
    letters = DeadLetters(js, pub)
    letter = await letters.get(result.seq)
    assert letter.reason == "malformed" and letter.headers[H_MSG_ID] == f"{agent}-big"
    cut = letter.headers[H_DLQ_TRUNCATED]
    assert cut.startswith(f"body={limit - 100};kept={len(letter.data)};headers=")
    assert len(letter.data) < len(body) and body.startswith(letter.data)
    assert header_size(letter.headers) + len(letter.data) <= limit
    seq = msg.metadata.sequence.stream
    assert letter.original_copy == f"failed.original.{STREAM_COMMANDS}.{seq}"
    original = await letters.original(letter)
    assert (original.subject, original.data) == (subject, body)
    assert original.headers[H_MSG_ID] == f"{agent}-big"
    # The kept original is not a dead letter of its own.
    assert [x.seq for x in await letters.list(subject_filter="failed.>")].count(result.seq) == 1
    assert all(not x.subject.startswith("failed.original.") for x in await letters.list())

    out = await asyncio.to_thread(
        CliRunner(env={"COLUMNS": "200"}).invoke,
        app,
        ["dlq", "show", str(result.seq), "--original", "--body-file", str(tmp_path / "b"),
         "--nats-url", js._nc.connected_url.geturl()],  # type: ignore[union-attr]
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert f"original of dead letter {result.seq}, on {subject}" in out.stdout
    listed = await asyncio.to_thread(
        CliRunner(env={"COLUMNS": "200"}).invoke,
        app,
        ["dlq", "ls", "--subject", f"failed.{subject}",
         "--nats-url", js._nc.connected_url.geturl()],  # type: ignore[union-attr]
    )  # fmt: skip
    assert "malformed (cut)" in listed.stdout
    assert f"body ({len(body)} bytes, binary; first 4096 shown" in out.stdout
    assert (tmp_path / "b").read_bytes() == body

    # Re-driven whole; the dead letter and its kept original then go.
    again = await letters.redrive(result.seq)
    back = await take(js, subject)
    assert back.data == body and again.msg_id == f"{agent}-big-redrive-{result.seq}"
    info = await js.stream_info(STREAM_FAILED, subjects_filter=letter.original_copy)
    assert not info.state.subjects


async def test_a_truncated_dead_letter_whose_original_is_gone_is_not_redriven(
    js: JetStreamContext, agent: str
) -> None:
    pub = Publisher(js, settings(), Metrics())
    subject = f"cmd.default.demo.{agent}.create"
    await pub.publish(subject, b"q" * (pub.limits().max_payload - 100))
    msg = await take(js, subject)
    result = await dead_letter(pub, msg, reason="malformed", error="not JSON", consumer="c")
    letters = DeadLetters(js, pub)
    await js.purge_stream(STREAM_FAILED, subject=(await letters.get(result.seq)).original_copy)
    with pytest.raises(MeshForgeError) as info:
        await letters.redrive(result.seq)
    assert "is truncated" in str(info.value) and "only its truncated copy is left" in str(
        info.value
    )
    assert "\n" not in str(info.value)
    assert (await letters.get(result.seq)).reason == "malformed"  # still there


async def test_a_dead_letter_with_headers_near_64k_drops_the_long_ones(
    js: JetStreamContext, agent: str
) -> None:
    pub = Publisher(js, settings(), Metrics())
    subject = f"cmd.default.demo.{agent}.create"
    big = "h" * 65_440
    await pub.publish(subject, b"not json", headers={"X-Big": big, "X-Small": "s"})
    msg = await take(js, subject)
    assert header_size(dict(msg.headers or {})) > 65_500  # stored; with Dlq-* it is over
    result = await dead_letter(pub, msg, reason="malformed", error="not JSON", consumer="c")
    letters = DeadLetters(js, pub)
    letter = await letters.get(result.seq)
    assert "X-Big" not in letter.headers and letter.headers["X-Small"] == "s"
    assert letter.data == b"not json" and letter.headers[H_DLQ_REASON] == "malformed"
    assert letter.truncated.endswith(";dropped=X-Big")
    original = await letters.original(letter)
    assert original.headers["X-Big"] == big and original.data == b"not json"


SHOWN_BODIES = {
    "nested_small": b"[" * 2000 + b"]" * 2000,
    "nested_huge": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "binary": bytes(range(256)) * 40,
    "huge_text": b"line of text\n" * 70_000,
    "markup": json.dumps({"x": "[bold red]not a style[/] \x1b[31m"}).encode(),
}


@pytest.mark.parametrize("kind", sorted(SHOWN_BODIES))
def test_dlq_show_prints_any_body(nats_url: str, kind: str) -> None:
    body = SHOWN_BODIES[kind]
    subject = f"failed.cmd.default.demo.show{uuid.uuid4().hex[:6]}.x"
    seq = asyncio.run(_store(nats_url, subject, body))
    out = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["dlq", "show", str(seq), "--nats-url", nats_url]
    )
    assert out.exit_code == 0, out.output
    assert out.exception is None and "Traceback" not in out.output
    assert "[/]" in out.stdout  # a header value with markup prints as it is
    assert "\x1b" not in out.stdout
    if len(body) > 4096:
        assert f"body ({len(body)} bytes" in out.stdout and "first 4096 shown" in out.stdout
        assert len(out.stdout) < 40_000
    if kind == "binary":
        assert "binary" in out.stdout
    if kind == "nested_small":
        assert "body (4000 bytes, text):" in out.stdout


async def _store(url: str, subject: str, body: bytes) -> int:
    async with await connect(settings(), url=url) as conn:
        await ensure(conn.js, default_streams(settings()), [])
        pub = Publisher(conn.js, settings(), Metrics())
        headers = {H_DLQ_REASON: "malformed", "X-Style": "[bold]x[/]"}
        return (await pub.publish(subject, body, headers=headers)).seq
