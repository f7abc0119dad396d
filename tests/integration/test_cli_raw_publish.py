"""`publish --raw` makes a malformed command on purpose; `dlq ls` on a fresh server; wide pipes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.demo import OrderAgent
from meshforge.transport.server import EmbeddedServer


def _cli(*args: str) -> tuple[int, str]:
    out = CliRunner().invoke(app, list(args))
    return out.exit_code, out.output


async def test_raw_bodies_become_dead_letters_that_say_what_is_wrong(
    agent_worker, meshforge_url: str, tmp_path: Path
) -> None:
    binary = tmp_path / "body.bin"
    binary.write_bytes(b'{"type": "order.create", "payload": {"sku": "\xff"}}')
    subject = "cmd.default.test.order.create"
    async with agent_worker(OrderAgent()) as h:
        for raw in ("not json", "[1, 2]", '{"type": "order.create", "payload": "x"}', f"@{binary}"):
            code, text = await asyncio.to_thread(
                _cli, "publish", subject, "--raw", raw, "--nats-url", meshforge_url
            )
            assert code == 0, text
            assert text.startswith("stream=MESHFORGE_COMMANDS seq=") and " bytes=" in text
        letters = await h.wait_dead_letters(4)
    assert [letter.reason for letter in letters] == ["malformed"] * 4
    errors = [letter.error for letter in letters]
    assert "body is not JSON: " in errors[0] and "'not json'" in errors[0]
    assert "body is a JSON list, expected an object" in errors[1]
    assert "'payload' is a JSON str, expected an object" in errors[2]
    assert "body is not UTF-8 at byte 45 (0xff)" in errors[3]
    assert letters[0].data == b"not json"  # sent as is: no envelope around it


def test_raw_refuses_a_json_argument_too_and_an_unreadable_file(meshforge_url: str) -> None:
    subject = "cmd.default.test.order.create"
    code, text = _cli("publish", subject, "{}", "--raw", "x", "--nats-url", meshforge_url)
    assert code == 2 and "not both" in text
    code, text = _cli("publish", subject, "--raw", "@/nonexistent/b", "--nats-url", meshforge_url)
    assert code == 2 and "cannot read '/nonexistent/b'" in text
    code, text = _cli("publish", subject, "--nats-url", meshforge_url)
    assert code == 2 and "--raw BYTES|@FILE" in text
    code, text = _cli("publish", subject, "[1]", "--nats-url", meshforge_url)
    assert code == 2 and "use --raw" in text


def test_dlq_ls_before_provisioning_says_none_and_how_to_provision(
    private_server: EmbeddedServer,
) -> None:
    code, text = _cli("dlq", "ls", "--nats-url", private_server.url)
    assert code == 0, text
    assert text.startswith("no dead letters") and "meshforge provision" in text


def test_piped_tables_are_not_cut_at_80_columns(
    private_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # a pipe, not a terminal (xdist sets one)
    code, text = _cli(
        "provision",
        "--dry-run",
        "--agent",
        "a_rather_long_agent_name_here",
        "--nats-url",
        private_server.url,
    )
    assert code == 0, text
    line = next(row for row in text.splitlines() if "MESHFORGE_COMMANDS/a_rather" in row)
    assert "filter_subject cmd.*.*.a_rather_long_agent_name_here.>" in line, text
    assert len(line) > 80
