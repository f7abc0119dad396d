"""An outbox relay killed with SIGKILL mid-batch, again and again, loses nothing and stores
nothing twice: every row reaches the stream, each msg id exactly once.

CHAOS_SCALE (``make chaos``: 20) multiplies the number of kills.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from meshforge.config import load_settings
from meshforge.envelope import H_MSG_ID, Envelope
from meshforge.publish.outbox import enqueue
from meshforge.store import open_store
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_EVENTS
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer

SCALE = int(os.environ.get("CHAOS_SCALE", "1"))
KILLS = 3 * SCALE
ROWS = 1500 + 400 * KILLS
BATCH = 50
SUBJECT = "evt.default.demo.chaos.happened"
SCRIPT = Path(__file__).with_name("outbox_relay.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60 * SCALE)]


def spawn(
    store_url: str, nats_url: str, progress: Path, crash_at: str | None = None
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "MESHFORGE_CRASH_AT"}
    if crash_at:
        env["MESHFORGE_CRASH_AT"] = crash_at
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), store_url, nats_url, str(progress), str(BATCH), "1.0"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def stored(js: JetStreamContext) -> int:
    info = await js.stream_info(STREAM_EVENTS)
    return int(info.state.messages)


async def all_ids(js: JetStreamContext) -> list[str]:
    sub = await js.pull_subscribe(SUBJECT, stream=STREAM_EVENTS)
    ids: list[str] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(500, timeout=1)
            except TimeoutError:
                return ids
            for msg in msgs:
                ids.append((msg.headers or {}).get(H_MSG_ID, ""))
                await msg.ack()
    finally:
        await sub.unsubscribe()


def wait_exit(proc: subprocess.Popen[bytes], within: float) -> int:
    try:
        return proc.wait(within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        raise AssertionError(f"relay did not finish in {within}s: {err[-2000:]}") from None


async def test_relay_killed_mid_batch_delivers_every_row_once(
    private_server: EmbeddedServer, tmp_path: Path
) -> None:
    store_url = f"sqlite:///{tmp_path / 'outbox.db'}"
    progress = tmp_path / "progress.txt"
    store = open_store(store_url)
    envs = [Envelope.new("chaos.happened", {"n": i}) for i in range(ROWS)]
    with store.transaction() as tx:
        for env in envs:
            enqueue(tx, SUBJECT, env)
    settings = load_settings({}, env={})
    async with await connect(settings, url=private_server.url) as conn:
        js = conn.js
        await ensure(js, default_streams(settings), [])

        # 1. Dies by its own hand right after publishing its 3rd batch, before marking it sent.
        proc = spawn(store_url, private_server.url, progress, crash_at="after_publish:3")
        assert await asyncio.to_thread(wait_exit, proc, 30) == -signal.SIGKILL
        assert await stored(js) == 3 * BATCH
        assert store.outbox_depth() == ROWS - 2 * BATCH  # the 3rd batch is still leased

        # 2. Killed from outside at a random point while it publishes.
        kills = 0
        rng = random.Random(7)
        while kills < KILLS:
            start = await stored(js)
            target = start + rng.randint(BATCH, 6 * BATCH)
            proc = spawn(store_url, private_server.url, progress)
            deadline = time.monotonic() + 30
            while await stored(js) < target and proc.poll() is None:
                assert time.monotonic() < deadline, "relay made no progress"
                await asyncio.sleep(0.002)  # polling the stream with a deadline
            if proc.poll() is not None:
                break  # it finished everything before the kill point: nothing left to kill
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
            kills += 1
        assert kills >= 1, "the relay finished before it could be killed once"
        print(f"outbox relay killed {kills} time(s) mid-run, once after publishing")

        # 3. Restarted, it finishes the job.
        proc = spawn(store_url, private_server.url, progress)
        assert await asyncio.to_thread(wait_exit, proc, 30) == 0
        assert store.outbox_depth() == 0

        ids = await all_ids(js)
        assert len(ids) == ROWS, f"{len(ids)} stored for {ROWS} rows"
        assert sorted(ids) == sorted(e.id for e in envs)  # each exactly once
        assert await stored(js) == ROWS
    lines = [line.split() for line in progress.read_text().splitlines()]
    duplicates = sum(int(d) for _, d in lines)
    assert duplicates >= BATCH, "the batch published before the crash was not re-published"
    store.close()
