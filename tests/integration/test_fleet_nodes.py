"""``meshforge ctl nodes``: every node the presence bucket knows, alive / late / gone."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fleet_support import Fleet, meshforge

from meshforge.config import load_settings
from meshforge.control import ControlClient
from meshforge.control.presence import Announcement, nodes_bucket, presence_key
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.transport.connection import Connection, connect

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def conn(nats_url: str) -> AsyncIterator[Connection]:
    connection = await connect(load_settings({"nats_url": nats_url}), name="nodes-test")
    await ensure(connection.js, default_streams(load_settings()), [])
    yield connection
    await connection.close()


def _ago(seconds: float) -> str:
    return (datetime.now(UTC) - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def test_ctl_nodes_shows_alive_late_and_gone_with_mailbox_depth(
    conn: Connection, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHFORGE_TEST_RUN_LOG", str(tmp_path / "runs.log"))
    site = f"s{uuid.uuid4().hex[:10]}"
    kv = await nodes_bucket(conn.js, create=True)
    assert kv is not None
    async with Fleet(nats_url, tmp_path) as fleet:
        runtime = await fleet.start(site, "up")
        assert runtime.presence.last is not None
        template = runtime.presence.last
        # Heard from 5 intervals ago (late) and 20 intervals ago (gone), and one that stopped.
        for name, note in [
            ("late", replace(template, node="late", last_seen=_ago(5))),
            ("gone", replace(template, node="gone", last_seen=_ago(20))),
            ("off", replace(template, node="off", state="stopped")),
        ]:
            await kv.put(presence_key(site, name), note.encode())
        await ControlClient(conn).send(site, "late", "echo", {})  # waits in its mailbox

        result = await meshforge("ctl", "nodes", "--site", site, "--json", "--nats-url", nats_url)
        assert result.returncode == 0, result.stderr
        listed = json.loads(result.stdout)
        assert (listed["announced"], listed["site"]) == (4, site)
        rows = {r["node"]: r for r in listed["nodes"]}
        assert {n: r["liveness"] for n, r in rows.items()} == {
            "gone": "gone", "late": "late", "off": "gone", "up": "alive",
        }  # fmt: skip
        assert rows["up"]["epoch"] == 1 and rows["up"]["version"] == template.version
        assert rows["late"]["mailbox_depth"] == 1 and rows["up"]["mailbox_depth"] == 0

        table = await meshforge("ctl", "nodes", "--site", site, "--nats-url", nats_url)
        assert table.returncode == 0 and f"{site}.late" in table.stdout and "late" in table.stdout
        mailboxes = listed["mailboxes"]  # every site's: the session server has other nodes
        assert table.stdout.splitlines()[0] == (
            f"4 announced at site {site}, {mailboxes} mailboxes (all sites)"
        )
    assert Announcement.decode(b"not json") is None
