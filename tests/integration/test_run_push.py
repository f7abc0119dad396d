"""``meshforge run --push --deliver-group``: worker processes share an agent's commands."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from meshforge.config import Settings
from meshforge.consume.push import deliver_subject
from meshforge.envelope import Envelope, decode
from meshforge.publish.publisher import Publisher
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_EVENTS
from meshforge.transport.connection import Connection
from meshforge.transport.server import EmbeddedServer
from polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
N = 40


def start(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_")}
    env["PYTHONPATH"] = f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests' / 'integration'}"
    return subprocess.Popen([sys.executable, "-m", "meshforge", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def group_members(server: EmbeddedServer, subject: str) -> int:
    # All of them: /connz lists 1,024 connections unless told, and a long session has more.
    url = f"http://127.0.0.1:{server.monitor_port}/connz?subs=detail&limit=100000"
    with urllib.request.urlopen(url, timeout=5) as resp:
        connz = json.loads(resp.read())
    return sum(
        1
        for c in connz.get("connections", [])
        for s in c.get("subscriptions_list_detail", [])
        if s.get("subject") == subject and s.get("qgroup") == "tally-workers"
    )


async def counted(conn: Connection) -> list[Envelope]:
    found, seq = [], 1
    while True:
        try:
            raw = await conn.js.get_msg(
                STREAM_EVENTS, seq=seq, subject="evt.default.test.tally.counted", next=True
            )
        except Exception:  # nothing at or after seq
            return found
        found.append(decode(raw.data or b"", raw.headers or {}))
        seq = (raw.seq or seq) + 1


async def test_two_workers_on_one_deliver_group_process_each_command_once(
    meshforge_connection: Connection, meshforge_settings: Settings,
    meshforge_server: EmbeddedServer, meshforge_store_url: str,
) -> None:  # fmt: skip
    args = ("run", "push_agents:TallyAgent", "--push", "--deliver-group", "tally-workers",
            "--store", meshforge_store_url, "--nats-url", meshforge_server.url)  # fmt: skip
    workers = [start(*args), start(*args)]
    subject = deliver_subject(STREAM_COMMANDS, "tally_consumer")
    try:

        def joined() -> bool:
            for proc in workers:
                assert proc.poll() is None, f"a worker exited: {proc.communicate()[1][-2000:]}"
            return group_members(meshforge_server, subject) == 2

        await wait_until(joined, timeout=30, what="both workers in the deliver group")
        publisher = Publisher(meshforge_connection.js, meshforge_settings)
        for n in range(N):
            await publisher.publish(
                "cmd.default.test.tally.count", Envelope.new("tally.count", {"n": n})
            )

        async def all_counted() -> bool:
            return len(await counted(meshforge_connection)) >= N

        await wait_until(all_counted, timeout=30, what=f"{N} counted events")
        info = await meshforge_connection.js.consumer_info(STREAM_COMMANDS, "tally_consumer")
    finally:
        results = []
        for proc in workers:
            proc.send_signal(signal.SIGTERM)
        for proc in workers:
            _, err = proc.communicate(timeout=30)
            results.append((proc.returncode, err))
    assert all(code == 0 for code, _ in results), results
    events = await counted(meshforge_connection)
    assert sorted(e.payload["n"] for e in events) == list(range(N))  # each once
    assert all(e.payload["before"] == 0 for e in events)
    assert {e.payload["pid"] for e in events} == {p.pid for p in workers}  # both took a share
    assert info.config.deliver_group == "tally-workers" and info.num_redelivered == 0


def test_push_needs_a_deliver_group() -> None:
    proc = start("run", "push_agents:TallyAgent", "--push")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "--push and --deliver-group NAME go together" in err
    proc = start("run", "push_agents:TallyAgent", "--push", "--deliver-group", "a.b")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "invalid deliver group 'a.b'" in err
