"""Dead letters against a real nats-server: CONTRACT headers, re-drive, purge, the dlq CLI."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.config import Settings, load_settings
from meshforge.deadletters.admin import DeadLetters
from meshforge.deadletters.route import (
    H_DLQ_CONSUMER,
    H_DLQ_DELIVERIES,
    H_DLQ_ERROR,
    H_DLQ_ORIGINAL_SUBJECT,
    H_DLQ_REASON,
    H_DLQ_STREAM,
    H_DLQ_STREAM_SEQ,
    H_DLQ_TIMESTAMP,
    REASONS,
    dead_letter,
    redrive_id,
)
from meshforge.envelope import H_MSG_ID, Envelope
from meshforge.errors import MeshForgeError, MissingTopology, PublishError
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_FAILED
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer

DLQ_HEADERS = {
    H_DLQ_REASON,
    H_DLQ_ERROR,
    H_DLQ_DELIVERIES,
    H_DLQ_ORIGINAL_SUBJECT,
    H_DLQ_STREAM,
    H_DLQ_STREAM_SEQ,
    H_DLQ_CONSUMER,
    H_DLQ_TIMESTAMP,
}


def settings(**values: object) -> Settings:
    return load_settings(values, env={})


@pytest.fixture
async def streams(js: JetStreamContext) -> JetStreamContext:
    await ensure(js, default_streams(settings()), [])
    return js


@pytest.fixture
async def agent(streams: JetStreamContext) -> AsyncIterator[str]:
    """A command agent name of this test alone; its commands and dead letters are purged after."""
    name = f"dl{uuid.uuid4().hex[:8]}"
    yield name
    await streams.purge_stream(STREAM_COMMANDS, subject=f"cmd.default.demo.{name}.>")
    await streams.purge_stream(STREAM_FAILED, subject=f"failed.cmd.default.demo.{name}.>")


async def fetch_one(js: JetStreamContext, subject: str, durable: str) -> Msg:
    sub = await js.pull_subscribe(subject, durable=durable, stream=STREAM_COMMANDS)
    try:
        [msg] = await sub.fetch(1, timeout=5)
        await msg.ack_sync()  # a work queue keeps it until acked; the Msg stays usable
    finally:
        await sub.unsubscribe()
    await js.delete_consumer(STREAM_COMMANDS, durable)
    return msg


async def command(js: JetStreamContext, agent: str, **headers: str) -> tuple[str, Envelope, Msg]:
    subject = f"cmd.default.demo.{agent}.create"
    env = Envelope.new(f"{agent}.create", {"sku": "A-1", "qty": 2})
    await Publisher(js, settings(), Metrics()).publish(subject, env, headers=headers or None)
    return subject, env, await fetch_one(js, subject, f"{agent}_t{uuid.uuid4().hex[:4]}")


async def test_dead_letter_carries_the_contract_headers(
    streams: JetStreamContext, agent: str
) -> None:
    subject, env, msg = await command(streams, agent, **{"X-Custom": "kept"})
    pub = Publisher(streams, settings(), Metrics())
    error = ValueError("bad value\nsecond line " + "x" * 3000)
    before = datetime.now(UTC) - timedelta(seconds=1)
    result = await dead_letter(
        pub, msg, reason="unrecoverable", error=error, consumer=f"{agent}_consumer"
    )
    assert result.stream == STREAM_FAILED and not result.duplicate
    stored = await streams.get_msg(STREAM_FAILED, result.seq)
    assert stored.subject == f"failed.{subject}"
    assert stored.data == msg.data == env.encode()
    headers = dict(stored.headers or {})
    original = dict(msg.headers or {})
    assert original == {**env.headers(), "X-Custom": "kept"}
    assert set(headers) == set(original) | DLQ_HEADERS
    assert {k: headers[k] for k in original} == original  # the original headers, untouched
    assert headers[H_MSG_ID] == env.id
    assert headers[H_DLQ_REASON] == "unrecoverable"
    assert headers[H_DLQ_ERROR].startswith("ValueError: bad value second line xxx")
    assert len(headers[H_DLQ_ERROR].encode()) <= 1024
    assert headers[H_DLQ_DELIVERIES] == "1"
    assert headers[H_DLQ_ORIGINAL_SUBJECT] == subject
    assert headers[H_DLQ_STREAM] == STREAM_COMMANDS
    assert headers[H_DLQ_STREAM_SEQ] == str(msg.metadata.sequence.stream)
    assert headers[H_DLQ_CONSUMER] == f"{agent}_consumer"
    stamp = datetime.fromisoformat(headers[H_DLQ_TIMESTAMP])
    assert before <= stamp <= datetime.now(UTC)

    # Written again after a crash: stored once.
    again = await dead_letter(
        pub, msg, reason="unrecoverable", error=error, consumer=f"{agent}_consumer"
    )
    assert again.duplicate and again.seq == result.seq
    assert await DeadLetters(streams, pub).count(f"failed.{subject}") == 1


async def test_dead_letter_without_an_id_or_with_directives(
    streams: JetStreamContext, agent: str
) -> None:
    subject = f"cmd.default.demo.{agent}.create"
    await streams.publish(subject, b"not json", headers={"Nats-Expected-Stream": STREAM_COMMANDS})
    msg = await fetch_one(streams, subject, f"{agent}_raw")
    pub = Publisher(streams, settings(), Metrics())
    result = await dead_letter(pub, msg, reason="malformed", error=None, consumer="c")
    stored = await streams.get_msg(STREAM_FAILED, result.seq)
    headers = dict(stored.headers or {})
    seq = msg.metadata.sequence.stream
    assert headers[H_MSG_ID] == f"dlq-{STREAM_COMMANDS}-{seq}"
    assert headers[H_DLQ_ERROR] == "malformed"
    assert "Nats-Expected-Stream" not in headers  # it would refuse the dead letter itself
    assert stored.data == b"not json"
    with pytest.raises(ValueError, match="reason must be one of"):
        await dead_letter(pub, msg, reason="oops", error=None, consumer="c")
    assert set(REASONS) == {
        "malformed", "unrecoverable", "invalid_payload", "max_deliveries", "expired", "rejected",
    }  # fmt: skip


async def test_redrive_moves_it_back_then_removes_it(streams: JetStreamContext, agent: str) -> None:
    subject, env, msg = await command(streams, agent)
    pub = Publisher(streams, settings(), Metrics())
    letters = DeadLetters(streams, pub)
    dl = await dead_letter(pub, msg, reason="max_deliveries", error="gave up", consumer="c")
    [listed] = await letters.list(subject_filter=f"failed.{subject}")
    assert (listed.seq, listed.reason, listed.error, listed.deliveries) == (
        dl.seq,
        "max_deliveries",
        "gave up",
        1,
    )
    assert listed.original_subject == subject and listed.stream == STREAM_COMMANDS

    result = await letters.redrive(dl.seq)
    assert result.stream == STREAM_COMMANDS and not result.duplicate
    assert result.msg_id == redrive_id(env.id, dl.seq)
    back = await fetch_one(streams, subject, f"{agent}_back")
    assert back.data == env.encode()
    assert dict(back.headers or {}) == {**env.headers(), H_MSG_ID: f"{env.id}-redrive-{dl.seq}"}
    with pytest.raises(MeshForgeError, match=f"no dead letter with id {dl.seq}"):
        await letters.get(dl.seq)
    with pytest.raises(MeshForgeError):
        await letters.redrive(dl.seq)


async def test_redrive_after_a_crash_before_the_delete_stores_one_copy(
    streams: JetStreamContext, agent: str
) -> None:
    subject, env, msg = await command(streams, agent)
    pub = Publisher(streams, settings(), Metrics())
    letters = DeadLetters(streams, pub)
    dl = await dead_letter(pub, msg, reason="expired", error="too late", consumer="c")
    # The first re-drive published, then died before deleting the dead letter.
    letter = await letters.get(dl.seq)
    await pub.publish(
        subject, letter.data, headers=letter.original_headers, msg_id=redrive_id(env.id, dl.seq)
    )
    result = await letters.redrive(dl.seq)
    assert result.duplicate
    info = await streams.stream_info(STREAM_COMMANDS, subjects_filter=subject)
    assert (info.state.subjects or {}).get(subject) == 1
    assert await letters.count(f"failed.{subject}") == 0


async def test_failed_redrive_keeps_the_dead_letter(streams: JetStreamContext, agent: str) -> None:
    pub = Publisher(streams, settings(), Metrics())
    letters = DeadLetters(streams, pub)
    nowhere = f"nostream.{agent}.x"
    dl = await pub.publish(
        f"failed.cmd.default.demo.{agent}.create",
        b"{}",
        headers={H_DLQ_ORIGINAL_SUBJECT: nowhere, H_DLQ_REASON: "rejected"},
    )
    with pytest.raises(PublishError) as info:
        await letters.redrive(dl.seq)
    assert info.value.kind == "no_stream" and nowhere in str(info.value)
    assert (await letters.get(dl.seq)).original_subject == nowhere


async def test_list_limit_filter_and_purge(streams: JetStreamContext, agent: str) -> None:
    pub = Publisher(streams, settings(), Metrics())
    letters = DeadLetters(streams, pub)
    base = f"failed.cmd.default.demo.{agent}"
    for i in range(5):
        await pub.publish(
            f"{base}.a", json.dumps({"n": i}).encode(), headers={H_DLQ_REASON: "rejected"}
        )
    for _ in range(3):
        await pub.publish(f"{base}.b", b"{}", headers={H_DLQ_REASON: "expired"})
    assert len(await letters.list(limit=4, subject_filter=f"{base}.>")) == 4
    only_b = await letters.list(subject_filter=f"{base}.b")
    assert [x.reason for x in only_b] == ["expired"] * 3
    assert [x.original_subject for x in only_b] == [f"cmd.default.demo.{agent}.b"] * 3
    first_a = (await letters.list(subject_filter=f"{base}.a"))[0]
    assert json.loads(first_a.data) == {"n": 0}
    assert await letters.purge(f"{base}.a") == 5
    assert await letters.count(f"{base}.>") == 3


async def test_whole_purge_and_a_missing_stream(private_server: EmbeddedServer) -> None:
    async with await connect(settings(), url=private_server.url) as conn:
        letters = DeadLetters(conn.js, Publisher(conn.js, settings(), Metrics()))
        with pytest.raises(MissingTopology, match="meshforge provision"):
            await letters.list()
        await ensure(conn.js, default_streams(settings()), [])
        for i in range(7):
            await letters.publisher.publish(f"failed.cmd.default.demo.x{i}.y", b"{}")
        assert await letters.purge() == 7
        assert await letters.list() == []


# ------------------------------------------------------------------ the CLI


async def _seed(url: str, agent: str) -> tuple[int, str]:
    async with await connect(settings(), url=url) as conn:
        await ensure(conn.js, default_streams(settings()), [])
        _, env, msg = await command(conn.js, agent)
        pub = Publisher(conn.js, settings(), Metrics())
        dl = await dead_letter(
            pub, msg, reason="rejected", error=RuntimeError("no stock"), consumer="c1"
        )
        return dl.seq, env.id


async def _count(url: str, subject: str) -> tuple[int, int]:
    async with await connect(settings(), url=url) as conn:
        letters = DeadLetters(conn.js, Publisher(conn.js, settings(), Metrics()))
        back = await conn.js.stream_info(STREAM_COMMANDS, subjects_filter=subject)
        await conn.js.purge_stream(STREAM_COMMANDS, subject=subject)
        return await letters.count(f"failed.{subject}"), sum((back.state.subjects or {}).values())


def test_cli_ls_show_redrive_purge(nats_url: str) -> None:
    runner = CliRunner(env={"COLUMNS": "200"})
    agent = f"cli{uuid.uuid4().hex[:6]}"
    subject = f"cmd.default.demo.{agent}.create"
    flt = ["--subject", f"failed.{subject}"]
    seq, env_id = asyncio.run(_seed(nats_url, agent))

    out = runner.invoke(app, ["dlq", "ls", *flt, "--nats-url", nats_url])
    assert out.exit_code == 0, out.output
    assert (
        str(seq) in out.stdout
        and "rejected" in out.stdout
        and "RuntimeError: no stock" in out.stdout
    )
    # The original subject's pattern, without "failed.", finds the same letters.
    bare = runner.invoke(
        app, ["dlq", "ls", "--subject", f"cmd.*.*.{agent}.>", "--nats-url", nats_url]
    )
    assert bare.exit_code == 0 and str(seq) in bare.stdout, bare.output

    out = runner.invoke(app, ["dlq", "show", str(seq), "--nats-url", nats_url])
    assert out.exit_code == 0, out.output
    for text in ("Dlq-Reason", "Dlq-Original-Subject", env_id, '"sku": "A-1"'):
        assert text in out.stdout

    out = runner.invoke(app, ["dlq", "redrive", str(seq), "--nats-url", nats_url])
    assert out.exit_code == 0, out.output
    assert f"re-drove {seq} -> {STREAM_COMMANDS}" in out.stdout
    assert asyncio.run(_count(nats_url, subject)) == (0, 1)

    asyncio.run(_seed(nats_url, agent))
    out = runner.invoke(app, ["dlq", "redrive", "--all", *flt, "--nats-url", nats_url])
    assert out.exit_code == 0 and "1 dead letter(s) re-driven" in out.stdout
    assert asyncio.run(_count(nats_url, subject)) == (0, 1)

    asyncio.run(_seed(nats_url, agent))
    out = runner.invoke(app, ["dlq", "purge", *flt, "--nats-url", nats_url], input="n\n")
    assert isinstance(out.exception, MeshForgeError) and "not confirmed" in str(out.exception)
    out = runner.invoke(app, ["dlq", "purge", "--yes", *flt, "--nats-url", nats_url])
    assert out.exit_code == 0 and "purged 1 dead letter(s)" in out.stdout
    assert asyncio.run(_count(nats_url, subject)) == (0, 0)

    out = runner.invoke(app, ["dlq", "ls", *flt, "--nats-url", nats_url])
    assert "no dead letters" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["redrive"], "give dead-letter ids or --all"),
        (["redrive", "1", "--all"], "give dead-letter ids or --all"),
        (["show", "999999999"], "no dead letter with id 999999999"),
    ],
)
def test_cli_errors_are_one_line(nats_url: str, args: list[str], message: str) -> None:
    asyncio.run(_provision(nats_url))
    out = CliRunner().invoke(app, ["dlq", *args, "--nats-url", nats_url])
    assert out.exit_code != 0
    assert isinstance(out.exception, MeshForgeError), out.output
    assert message in str(out.exception) and "\n" not in str(out.exception)


def test_cli_a_bad_subject_pattern_is_a_usage_error(nats_url: str) -> None:
    out = CliRunner().invoke(app, ["dlq", "ls", "--subject", "failed..x", "--nats-url", nats_url])
    assert out.exit_code == 2 and "invalid subject" in out.output


async def _provision(url: str) -> None:
    async with await connect(settings(), url=url) as conn:
        await ensure(conn.js, default_streams(settings()), [])
