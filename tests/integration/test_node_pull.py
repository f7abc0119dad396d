"""A node at fleet scale: how often its long poll costs its server something, that a lost
request is renewed at the reconnect, not after its heartbeats went silent, and that a
command taken twice at once (a loaded node's redelivery) runs once (CONTROL_PLANE.md).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest
from control_support import runs, stored_count
from fleet_support import Fleet
from nats.aio.msg import Msg

from meshforge.config import load_settings
from meshforge.control import ControlClient
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_CONTROL, control_command_subject
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer
from polling import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def run_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "runs.log"
    monkeypatch.setenv("MESHFORGE_TEST_RUN_LOG", str(path))
    return path


async def _first_pull(nats_url: str, tmp_path: Path, **settings: object) -> dict[str, int]:
    """The body of the first pull request a node sends for its mailbox, as the server gets it."""
    site = f"s{uuid.uuid4().hex[:10]}"
    spy = await connect(load_settings({"nats_url": nats_url}), name="node-pull-spy")
    seen: asyncio.Queue[Msg] = asyncio.Queue()
    api = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM_CONTROL}.node_{site}_n1"
    await spy.nc.subscribe(api, cb=seen.put)
    await spy.nc.flush()
    try:
        async with Fleet(nats_url, tmp_path, **settings) as fleet:
            await fleet.start(site, "n1")
            request = await asyncio.wait_for(seen.get(), 30)
    finally:
        await spy.close()
    body: dict[str, int] = json.loads(request.data)
    return body


async def test_an_idle_node_hears_from_its_server_every_node_pull_heartbeat(
    nats_url: str, tmp_path: Path
) -> None:
    default = await _first_pull(nats_url, tmp_path)
    # 5 s, not the workers' 1 s: 10,000 idle nodes cost their server 2,000 heartbeats a
    # second instead of 10,000 (benchmarks/RESULTS.md, the fleet).
    assert (default["idle_heartbeat"], default["expires"]) == (5 * 10**9, 25 * 10**9)
    chosen = await _first_pull(nats_url, tmp_path, node_pull_heartbeat="2s")
    assert chosen["idle_heartbeat"] == 2 * 10**9


async def test_a_node_answers_at_once_after_its_server_restarts(
    private_server: EmbeddedServer, tmp_path: Path, run_log: Path
) -> None:
    # Heartbeats every 30 s: found silent only after 60 s. The restart must not wait for that.
    site = "restarts"
    async with Fleet(private_server.url, tmp_path, node_pull_heartbeat="30s") as fleet:
        assert fleet.conn is not None
        await ensure(fleet.conn.js, default_streams(fleet.settings), [])
        ctl = ControlClient(fleet.conn)
        await fleet.start(site, "n1")
        first = await ctl.send(site, "n1", "echo", {"n": 1})
        assert (await ctl.wait_reply(site, "n1", first, timeout=20)) is not None
        private_server.restart()
        restarted = time.monotonic()
        second = await ctl.send(site, "n1", "echo", {"n": 2})
        reply = await ctl.wait_reply(site, "n1", second, timeout=20)
        took = time.monotonic() - restarted
        assert reply is not None and reply.status == "ok", (
            f"no reply {took:.1f}s after the restart: the node's pull request died with "
            "the connection and was not renewed at the reconnect"
        )


async def test_a_command_delivered_twice_at_once_runs_once(
    nats_url: str, tmp_path: Path, run_log: Path
) -> None:
    # Two copies of one command in the mailbox (a re-send under another message id; or a
    # redelivery after the ack wait ran out on a loaded node): the node takes both at once.
    site = f"s{uuid.uuid4().hex[:10]}"
    async with Fleet(nats_url, tmp_path) as fleet:
        conn = fleet.conn
        assert conn is not None
        ctl = ControlClient(conn)
        await fleet.start(site, "n1")
        item = ctl.command(site, "n1", "sleep", {"seconds": 1.0})
        for msg_id in (item.msg_id, f"{item.msg_id}-copy"):
            await ctl.publisher.publish(
                item.subject, item.data, headers=item.headers, msg_id=msg_id
            )
        mailbox = control_command_subject(site, "n1")

        async def both_answered() -> bool:
            return await stored_count(conn.js, STREAM_CONTROL, mailbox) == 0

        await wait_until(both_answered, timeout=30, what="both copies acknowledged")
        reply = await ctl.wait_reply(site, "n1", item.msg_id, timeout=20)
        assert reply is not None and reply.status == "ok"
        ran = [command_id for command_id, _, _ in runs(run_log)]
        assert ran == [item.msg_id], f"the command ran {len(ran)} times"
