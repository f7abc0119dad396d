"""`meshforge events tail`: the last stored events, since a time, as JSON, and following new ones."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.config import load_settings
from meshforge.envelope import Envelope
from meshforge.publish.publisher import Publisher
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer

ROOT = Path(__file__).resolve().parents[2]


async def _publish(url: str, *subjects_and_bodies: tuple[str, Envelope | bytes]) -> None:
    settings = load_settings({"nats_url": url}, env={})
    async with await connect(settings) as conn:
        await ensure(conn.js, default_streams(settings), [])
        publisher = Publisher(conn.js, settings)
        for subject, body in subjects_and_bodies:
            await publisher.publish(subject, body)


def _event(n: int) -> tuple[str, Envelope]:
    agent = "order" if n % 2 else "inventory"
    return f"evt.default.demo.{agent}.created", Envelope.new(f"{agent}.created", {"n": n})


def _tail(url: str, *args: str) -> list[str]:
    out = CliRunner().invoke(app, ["events", "tail", *args, "--nats-url", url])
    assert out.exit_code == 0, out.output
    return out.output.splitlines()


async def test_tail_shows_the_last_stored_then_stops_without_follow(
    private_server: EmbeddedServer,
) -> None:
    url = private_server.url
    await _publish(
        url, *[_event(n) for n in range(30)], ("evt.default.demo.order.raw", b"\xffnot json")
    )
    lines = await asyncio.to_thread(_tail, url, "--no-follow")
    assert len(lines) == 10
    assert lines[-1].endswith("evt.default.demo.order.raw (not an envelope) \\xffnot json")
    assert " #22 evt.default.demo.order.created order.created id=" in lines[0]
    assert lines[0].endswith('{"n": 21}') and lines[1].endswith('{"n": 22}')
    # A pattern: the last 3 of the order agent's only (the probe looks back far enough).
    lines = await asyncio.to_thread(_tail, url, "evt.*.*.order.created", "-n", "3", "--no-follow")
    assert [line.rsplit(" ", 1)[1] for line in lines] == ["25}", "27}", "29}"]
    everything = await asyncio.to_thread(_tail, url, "--all", "--no-follow", "--json")
    rows = [json.loads(line) for line in everything]
    assert [r["seq"] for r in rows] == list(range(1, 32))
    assert rows[0]["body"]["payload"] == {"n": 0} and rows[0]["headers"]["Nats-Msg-Id"]
    assert rows[-1]["body"] == "\\xffnot json"
    since = await asyncio.to_thread(_tail, url, "--since", "1h", "--no-follow", "--count", "5")
    assert len(since) == 5 and " #1 " in since[0]
    future = await asyncio.to_thread(_tail, url, "--since", "2100-01-01T00:00:00Z", "--no-follow")
    assert future == []


async def test_tail_follows_new_events_until_count(private_server: EmbeddedServer) -> None:
    url = private_server.url
    await _publish(url, _event(0))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshforge", "events", "tail", "-n", "0", "--count", "2", "--nats-url", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        # The tail sees only what comes after it started: publish until it has two lines.
        for n in range(1, 200):
            await _publish(url, _event(n))
            if proc.returncode is not None:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.1)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert proc.returncode == 0, err
    lines = out.decode().splitlines()
    assert len(lines) == 2 and '{"n": 0}' not in lines[0]


def test_tail_says_in_one_line_what_it_cannot_read(private_server: EmbeddedServer) -> None:
    url = private_server.url
    out = CliRunner().invoke(app, ["events", "tail", "--no-follow", "--nats-url", url])
    assert out.exit_code == 1 and "no stream stores 'evt.>'" in str(out.exception)
    asyncio.run(_publish(url))  # the streams, no message
    out = CliRunner().invoke(app, ["events", "tail", "cmd.>", "--nats-url", url])
    assert out.exit_code == 1 and "a work queue" in str(out.exception)
    assert "\n" not in str(out.exception)
    assert _tail(url, "--no-follow") == []
    out = CliRunner().invoke(app, ["events", "tail", "--since", "yesterday", "--nats-url", url])
    assert out.exit_code == 2 and "--since" in out.output
