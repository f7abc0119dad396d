"""Issue 35: a producer's bytes never decide what the dead-letter tools read, purge or crash on.

Each scenario is the attack or the everyday accident of the issue, on a real nats-server:
forged ``Dlq-*`` headers naming another tenant's kept original (read, re-drive), a forged
``Dlq-Original: >`` (one re-drive wiping the stream), an accented error (``dlq ls`` dying
on nats-py's ``email.header.Header``), and the console bound to a tenant.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from console_client import Browser
from dlq_support import take
from nats.js import JetStreamContext
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.config import Settings, load_settings
from meshforge.console.app import create_app
from meshforge.console.auth import ConsoleTokens
from meshforge.deadletters.admin import DeadLetters
from meshforge.deadletters.originals import original_copy_subject
from meshforge.deadletters.route import dead_letter
from meshforge.errors import MeshForgeError
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_FAILED
from meshforge.transport.connection import Connection, connect
from meshforge.transport.server import EmbeddedServer

SECRET = b"OTHER-TENANT-SECRET:"
VIEWER, OPERATOR = "viewer-" + uuid.uuid4().hex, "operator-" + uuid.uuid4().hex


@dataclass
class Rig:
    url: str
    settings: Settings
    conn: Connection
    pub: Publisher

    @property
    def js(self) -> JetStreamContext:
        return self.conn.js


@pytest.fixture
async def rig(private_server: EmbeddedServer) -> AsyncIterator[Rig]:
    """A server of this test alone: a forged ``>`` on today's code empties its whole stream."""
    settings = load_settings({"nats_url": private_server.url}, env={})
    conn = await connect(settings, name="dlq-trust")
    await ensure(conn.js, default_streams(settings), [])
    yield Rig(private_server.url, settings, conn, Publisher(conn.js, settings, Metrics()))
    await conn.close()


async def dead_lettered(
    rig: Rig,
    subject: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    error: str = "ValueError: not JSON",
) -> tuple[int, int]:
    """A producer's command on ``subject`` dead-lettered by the router: (letter id, command seq)."""
    ack = await rig.js.publish(subject, body, headers=headers, stream=STREAM_COMMANDS)
    msg = await take(rig.js, subject)
    result = await dead_letter(rig.pub, msg, reason="malformed", error=error, consumer="trust")
    return result.seq, int(ack.seq)


async def other_tenants_truncated_letter(rig: Rig) -> tuple[int, str]:
    """Tenant other's dead letter too big to keep whole: (its id, its kept original's subject)."""
    limit = rig.pub.limits().max_payload
    subject = "cmd.other.demo.order.create"
    body = SECRET + b"x" * (limit - 100 - len(SECRET))
    ack = await rig.pub.publish(subject, body, msg_id=f"other-{uuid.uuid4().hex}")
    msg = await take(rig.js, subject)
    result = await dead_letter(rig.pub, msg, reason="malformed", error="not JSON", consumer="c")
    letter = await DeadLetters(rig.js, rig.pub).get(result.seq)
    assert letter.truncated, "the setup needs a truncated letter with a kept original"
    return result.seq, original_copy_subject(STREAM_COMMANDS, ack.seq)


async def kept_chunks(js: JetStreamContext, copy: str) -> int:
    info = await js.stream_info(STREAM_FAILED, subjects_filter=copy)
    return int((info.state.subjects or {}).get(copy, 0))


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


async def test_a_producers_dlq_headers_reach_the_letter_renamed_and_its_command_is_handled(
    rig: Rig,
) -> None:
    forged = {"Dlq-Reason": "expired", "Dlq-Truncated": "body", "dlq-original": ">"}
    seq, cmd_seq = await dead_lettered(rig, "cmd.acme.demo.order.create", b"{", forged)
    letter = await DeadLetters(rig.js, rig.pub).get(seq)
    assert letter.reason == "malformed" and not letter.truncated and letter.original_copy == ""
    assert letter.stream_seq == cmd_seq
    assert letter.headers["Producer-Dlq-Truncated"] == "body"
    assert letter.headers["Producer-dlq-original"] == ">"
    assert not any(k.lower() == "dlq-original" for k in letter.headers)


async def test_a_forged_dlq_original_never_reads_another_tenants_kept_original(rig: Rig) -> None:
    _, copy = await other_tenants_truncated_letter(rig)
    forged = {"Dlq-Truncated": "body", "Dlq-Original": copy}
    seq, _ = await dead_lettered(rig, "cmd.acme.demo.order.create", b"acme: not json", forged)
    letters = DeadLetters(rig.js, rig.pub)
    letter = await letters.get(seq)
    original = await letters.original(letter)
    assert original.subject == "cmd.acme.demo.order.create"
    assert original.data == b"acme: not json" and SECRET not in original.data


async def test_a_stored_forged_link_to_another_original_is_refused_on_read(rig: Rig) -> None:
    """A letter stored before the router renamed forgeries: the library checks the link."""
    _, copy = await other_tenants_truncated_letter(rig)
    other_seq = copy.rsplit(".", 1)[1]
    letters = DeadLetters(rig.js, rig.pub)
    planted = [
        # names another original than its own (its own sequence is 999)
        {"Dlq-Truncated": "body", "Dlq-Original": copy, "Dlq-Stream-Seq": "999"},
        # names its own sequence family, but the kept original there is another subject's
        {"Dlq-Truncated": "body", "Dlq-Stream-Seq": other_seq},
    ]
    for extra in planted:
        headers = {
            "Dlq-Reason": "malformed",
            "Dlq-Original-Subject": "cmd.acme.demo.order.create",
            "Dlq-Stream": STREAM_COMMANDS,
            **extra,
        }
        ack = await rig.js.publish(
            "failed.cmd.acme.demo.order.create", b"{", headers=headers, stream=STREAM_FAILED
        )
        letter = await letters.get(ack.seq)
        with pytest.raises(MeshForgeError) as info:
            await letters.original(letter)
        assert SECRET.decode() not in str(info.value)
        with pytest.raises(MeshForgeError):
            await letters.redrive(ack.seq)
    assert await kept_chunks(rig.js, copy) >= 1


async def test_redriving_a_forged_letter_neither_deletes_nor_republishes_another_tenants_original(
    rig: Rig,
) -> None:
    other, copy = await other_tenants_truncated_letter(rig)
    chunks = await kept_chunks(rig.js, copy)
    forged = {"Dlq-Truncated": "body", "Dlq-Original": copy}
    seq, _ = await dead_lettered(rig, "cmd.acme.demo.order.create", b"acme: not json", forged)
    letters = DeadLetters(rig.js, rig.pub)
    result = await letters.redrive(seq)
    again = await rig.js.get_msg(STREAM_COMMANDS, seq=result.seq)
    assert again.subject == "cmd.acme.demo.order.create"
    assert again.data == b"acme: not json"
    assert await kept_chunks(rig.js, copy) == chunks
    whole = await letters.original(await letters.get(other))
    assert whole.data.startswith(SECRET)


async def test_a_forged_wildcard_original_never_wipes_the_dead_letter_stream(rig: Rig) -> None:
    # The acme letter comes first, so today's code finds its own forged chunk under '>'.
    forged = {
        "Dlq-Truncated": "body",
        "Dlq-Original": ">",
        "Dlq-Chunk": "1/1",
        "Dlq-Original-Headers": "2",
    }
    seq, _ = await dead_lettered(rig, "cmd.acme.demo.order.create", b"{}acme", forged)
    for i in range(3):
        await dead_lettered(rig, f"cmd.other.demo.order.n{i}", b"not json")
    other, copy = await other_tenants_truncated_letter(rig)
    letters = DeadLetters(rig.js, rig.pub)
    before = await letters.count("failed.cmd.other.>")
    assert before == 4

    code, out = await asyncio.to_thread(cli, "dlq", "redrive", str(seq), "--nats-url", rig.url)
    assert code == 0, out
    assert await letters.count("failed.cmd.other.>") == before
    assert await kept_chunks(rig.js, copy) >= 1
    assert (await letters.get(other)).truncated


async def test_an_accented_error_and_header_never_take_the_dlq_tools_down(rig: Rig) -> None:
    seq, _ = await dead_lettered(
        rig,
        "cmd.acme.demo.order.create",
        "café crème: not json".encode(),
        {"X-Name": "José", "X-Bidi": "a\u202eb"},
        error="JSONDecodeError: café crème: not json",
    )
    code, out = await asyncio.to_thread(cli, "dlq", "ls", "--nats-url", rig.url)
    assert code == 0, out
    assert "café crème" in out
    code, out = await asyncio.to_thread(cli, "dlq", "show", str(seq), "--nats-url", rig.url)
    assert code == 0, out
    assert "José" in out and "café crème" in out and "\u202e" not in out
    code, out = await asyncio.to_thread(cli, "dlq", "ls", "--json", "--nats-url", rig.url)
    assert code == 0, out
    [row] = json.loads(out)
    assert row["error"] == "JSONDecodeError: café crème: not json"
    assert out.isascii()


async def test_dlq_ls_json_gives_every_field_a_script_needs(rig: Rig) -> None:
    seq, _ = await dead_lettered(rig, "cmd.acme.demo.order.create", b"{")
    other, _ = await other_tenants_truncated_letter(rig)
    code, out = await asyncio.to_thread(cli, "dlq", "ls", "--json", "--nats-url", rig.url)
    assert code == 0, out
    rows = json.loads(out)
    assert [r["id"] for r in rows] == [seq, other]
    assert set(rows[0]) == {"id", "subject", "reason", "error", "deliveries", "time", "truncated"}
    assert rows[0]["subject"] == "cmd.acme.demo.order.create" and rows[0]["reason"] == "malformed"
    assert rows[0]["deliveries"] == 1 and rows[0]["time"].endswith("Z")
    assert [r["truncated"] for r in rows] == [False, True]
    code, out = await asyncio.to_thread(
        cli, "dlq", "ls", "--json", "--tenant", "acme", "--nats-url", rig.url
    )
    assert code == 0 and [r["id"] for r in json.loads(out)] == [seq]


async def test_a_tenant_bound_api_never_reads_redrives_or_purges_another_tenant(
    rig: Rig,
) -> None:
    other, copy = await other_tenants_truncated_letter(rig)
    mine, _ = await dead_lettered(rig, "cmd.acme.demo.order.create", b"{")
    acme = DeadLetters(rig.js, rig.pub, tenant="acme")
    assert [x.seq for x in await acme.list()] == [mine] and await acme.count() == 1
    with pytest.raises(MeshForgeError, match=f"no dead letter with id {other}"):
        await acme.get(other)
    with pytest.raises(MeshForgeError, match=f"no dead letter with id {other}"):
        await acme.redrive(other)
    for pattern in ("failed.>", "failed.cmd.other.>", "failed.original.>", "failed.cmd.*.>"):
        with pytest.raises(MeshForgeError, match="bound to tenant 'acme'"):
            await acme.purge(pattern)
    assert await acme.purge() == 1
    assert await DeadLetters(rig.js, rig.pub).count() == 1 and await kept_chunks(rig.js, copy) > 0


class ConsoleClient:
    """The console app bound to ``--tenant acme``, called in this loop over ASGI, sharing the
    test's NATS connection (no child process, no HTTP client library)."""

    def __init__(self, rig: Rig) -> None:
        settings = load_settings({"nats_url": rig.url, "tenant": "acme"}, env={})
        tokens = ConsoleTokens(viewer=VIEWER, operator=OPERATOR)
        self.app = create_app(settings, nats_url=rig.url, tokens=tokens)
        self.app.state.console.conn = rig.conn

    async def call(self, method: str, target: str, token: str) -> tuple[int, str]:
        path, _, query = target.partition("?")
        headers = {"authorization": f"Bearer {token}"}
        if method == "POST":
            headers["content-type"] = "application/x-www-form-urlencoded"
        answer = await Browser(self.app).request(method, path, query=query, headers=headers)
        assert answer.raised is None, answer.raised
        return answer.status, answer.body.decode()


async def test_a_console_bound_to_acme_never_serves_or_redrives_another_tenants_original(
    rig: Rig,
) -> None:
    _, copy = await other_tenants_truncated_letter(rig)
    chunks = await kept_chunks(rig.js, copy)
    forged = {"Dlq-Truncated": "body", "Dlq-Original": copy}
    seq, _ = await dead_lettered(rig, "cmd.acme.demo.order.create", b"acme: not json", forged)

    console = ConsoleClient(rig)
    status, text = await console.call("GET", f"/dead-letters/{seq}?original=1", VIEWER)
    posted, _ = await console.call("POST", f"/dead-letters/{seq}/redrive", OPERATOR)
    assert status == 200 and "acme: not json" in text
    assert SECRET.decode() not in text and "cmd.other" not in text
    assert posted == 303
    assert await kept_chunks(rig.js, copy) == chunks
    info = await rig.js.stream_info(STREAM_COMMANDS, subjects_filter="cmd.acme.>")
    assert info.state.messages == 1
    last = await rig.js.get_last_msg(STREAM_COMMANDS, "cmd.acme.demo.order.create")
    assert last.data == b"acme: not json"


async def test_the_console_lists_and_shows_an_accented_letter(rig: Rig) -> None:
    seq, _ = await dead_lettered(
        rig,
        "cmd.acme.demo.order.create",
        "café crème: not json".encode(),
        {"X-Name": "José"},
        error="JSONDecodeError: café crème: not json",
    )

    console = ConsoleClient(rig)
    status, listed = await console.call("GET", "/dead-letters", VIEWER)
    shown_status, shown = await console.call("GET", f"/dead-letters/{seq}", VIEWER)
    assert status == 200 and "café crème" in listed
    assert shown_status == 200 and "José" in shown
