"""A fleet of many nodes: no silent cap, a start that costs the same however many nodes
there are, listings never short, and reads of the whole fleet in a few requests."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import nats
import pytest
from fleet_support import Fleet, meshforge
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig

from meshforge.config import load_settings
from meshforge.console.status import StatusReader
from meshforge.control import ControlClient
from meshforge.control.fleet import survey
from meshforge.control.presence import nodes_bucket, presence_key
from meshforge.topology.provision import apply, ensure, plan
from meshforge.topology.specs import default_streams, node_consumer
from meshforge.transport.buckets import key_value
from meshforge.transport.connection import connect
from meshforge.transport.listing import read_bucket
from meshforge.transport.server import EmbeddedServer

pytestmark = pytest.mark.timeout(240)


class ApiRequests:
    """Every JetStream API request the server receives, seen from a connection of its own."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.subjects: list[str] = []

    async def _seen(self, msg: Msg) -> None:
        self.subjects.append(msg.subject.removeprefix("$JS.API."))

    async def caught_up(self, other: NATS) -> None:
        """Everything ``other`` sent so far is counted: its requests reached the server
        before its PONG, and were forwarded here before our own PONG."""
        await other.flush()
        await self.nc.flush()

    def since(self, mark: int) -> Counter[str]:
        """The requests after ``mark`` by kind (the API name, without stream and consumer),
        leaving out the pulls of a running consumer."""
        kinds = Counter(".".join(s.split(".")[:2]) for s in self.subjects[mark:])
        del kinds["CONSUMER.MSG"]
        return kinds


@asynccontextmanager
async def api_requests(url: str) -> AsyncIterator[ApiRequests]:
    nc = await nats.connect(url)
    seen = ApiRequests(nc)
    await nc.subscribe("$JS.API.>", cb=seen._seen)
    await nc.flush()
    try:
        yield seen
    finally:
        await nc.close()


async def test_a_node_start_costs_the_same_requests_with_5_or_300_other_nodes(
    private_server: EmbeddedServer, tmp_path: Path
) -> None:
    settings = load_settings({"nats_url": private_server.url})
    site = "plant"
    async with (
        await connect(settings, name="setup") as admin,
        api_requests(private_server.url) as seen,
        Fleet(private_server.url, tmp_path) as fleet,
    ):
        assert fleet.conn is not None
        await ensure(admin.js, default_streams(settings))
        await nodes_bucket(admin.js, create=True)  # made by the first node: not a start's cost
        costs = []
        for others in (5, 300):  # 300: past the 256 consumers of one CONSUMER.LIST page
            have = (await admin.js.stream_info("MESHFORGE_CONTROL")).state.consumer_count
            specs = [node_consumer(site, f"n{i}", settings) for i in range(have, others)]
            await ensure(admin.js, default_streams(settings), specs)
            mark = len(seen.subjects)
            await fleet.start(site, f"new{others}")
            await seen.caught_up(fleet.conn.nc)
            costs.append(seen.since(mark))
        assert costs[0] == costs[1], costs
        assert "CONSUMER.LIST" not in costs[1] and sum(costs[1].values()) <= 15, costs[1]


async def test_a_node_past_the_consumer_limit_exits_naming_the_setting(
    private_server: EmbeddedServer, tmp_path: Path
) -> None:
    url = private_server.url
    limited = {"MESHFORGE_CONTROL_MAX_CONSUMERS": "3"}
    shown = await meshforge("provision", "--dry-run", "--nats-url", url)
    assert "takes any number of consumers" in shown.stdout, shown.stdout
    done = await meshforge(
        "provision", "--site", "lab", "--node", "a", "--node", "b", "--node", "c",
        "--nats-url", url, env=limited,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "takes at most 3 consumers" in done.stdout

    fourth = await meshforge(
        "node", "lab", "d", "--store", f"sqlite:///{tmp_path / 'd.db'}", "--nats-url", url,
        env=limited,
    )  # fmt: skip
    assert fourth.returncode == 1
    errors = [line for line in fourth.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: consumer node_lab_d refused: stream MESHFORGE_CONTROL is at its consumer limit "
        "of 3 (max_consumers); raise the setting control_max_consumers "
        "(MESHFORGE_CONTROL_MAX_CONSUMERS; -1: unlimited) and run `meshforge provision`"
    ], fourth.stderr

    # Whatever announced, a job to the site refuses: nodes past the limit never started.
    conn = await connect(load_settings({"nats_url": url}), name="announcer")
    async with conn:
        kv = await nodes_bucket(conn.js, create=True)
        assert kv is not None
        async with Fleet(url, tmp_path, control_max_consumers=3) as fleet:
            await fleet.start("lab", "a")
            job = await meshforge(
                "ctl", "job", "create", "j1", "--command", "echo", "--site", "lab", "--nats-url", url,
                env=limited,
            )  # fmt: skip
            assert job.returncode == 1
            assert job.stderr.count("\n") == 1 and "can be incomplete" in job.stderr, job.stderr
            assert "1 announced at site lab, 3 mailboxes (all sites) of at most 3" in job.stderr

            nodes = await meshforge("ctl", "nodes", "--nats-url", url)
            assert nodes.stdout.splitlines()[0] == (
                "1 announced, 3 mailboxes of at most 3 (control_max_consumers)"
            )
            listed = json.loads(
                (await meshforge("ctl", "nodes", "--json", "--nats-url", url)).stdout
            )
            assert (listed["announced"], listed["mailboxes"], listed["mailbox_limit"]) == (1, 3, 3)


async def test_a_listing_of_5000_keys_is_never_short_while_they_are_rewritten(
    nats_url: str, nc: NATS
) -> None:
    # nats-py's keys() came back short or empty here (its end is a pending count that a
    # rewrite, deleting the key's previous revision, brings to 0 too early).
    bucket = f"LIST{uuid.uuid4().hex[:8]}"
    js = nc.jetstream()
    kv = await key_value(js, KeyValueConfig(bucket=bucket, history=1))
    assert kv is not None
    keys = {f"site.n{i}" for i in range(5000)}
    for key in keys:  # fire and forget; the acknowledged writes below come after them all
        await nc.publish(f"$KV.{bucket}.{key}", b"{}")
    await kv.delete("site.n0")
    await kv.put("site.n1", b"newer")
    keys.discard("site.n0")
    writing = True

    async def rewrite() -> None:  # presence-like churn: every key again and again
        i = 0
        while writing:
            await nc.publish(f"$KV.{bucket}.site.n{2 + i % 4998}", b"{}")
            i += 1
            if i % 50 == 0:
                await asyncio.sleep(0.001)  # pacing the load, not waiting for anything

    writer = asyncio.create_task(rewrite())
    try:
        for _ in range(100):
            fresh = await nats.connect(nats_url)
            try:
                entries = await read_bucket(fresh.jetstream(), bucket)
            finally:
                await fresh.close()
            assert set(entries) == keys
            assert entries["site.n1"].data == b"newer"
    finally:
        writing = False
        await writer
    await js.delete_key_value(bucket)


async def test_reading_the_fleet_costs_a_few_requests_and_the_console_agrees(
    private_server: EmbeddedServer, tmp_path: Path
) -> None:
    settings = load_settings({"nats_url": private_server.url})
    count = 300
    async with await connect(settings, name="fleet-reader") as conn:
        specs = [node_consumer("big", f"n{i}", settings) for i in range(count - 10)]
        await ensure(conn.js, default_streams(settings), specs)
        kv = await nodes_bucket(conn.js, create=True)
        assert kv is not None
        async with Fleet(private_server.url, tmp_path) as fleet:
            template = (await fleet.start("big", "n0")).presence.last
            assert template is not None
            for i in range(1, count):
                await kv.put(presence_key("big", f"n{i}"), replace(template, node=f"n{i}").encode())
            for i in range(0, count, 7):  # some mailboxes with commands waiting
                await ControlClient(conn).send("big", f"q{i}", "echo", {})
            async with api_requests(private_server.url) as seen:
                fleet_view = await survey(conn.js)
                await seen.caught_up(conn.nc)
                survey_cost = seen.since(0)
                mark = len(seen.subjects)
                overview = await StatusReader(conn).overview()
                await seen.caught_up(conn.nc)
                overview_cost = seen.since(mark)
        assert sum(survey_cost.values()) <= 5, survey_cost
        assert sum(overview_cost.values()) <= 12, overview_cost
        assert fleet_view.announced == overview.nodes_known == count
        # 290 nodes have a mailbox (a consumer); 10 announced without one.
        assert fleet_view.mailboxes.count == overview.mailboxes == count - 10
        assert fleet_view.summary() == f"{count} announced, {count - 10} mailboxes"
        waiting = {f"control.cmd.big.q{i}": 1 for i in range(0, count, 7)}
        assert fleet_view.mailboxes.depths == waiting


async def test_the_1001st_node_starts_where_the_servers_default_would_refuse_it(
    private_server: EmbeddedServer, tmp_path: Path
) -> None:
    # nats-server 2.15 gives a stream that sets no limit 1000 consumers: provisioning sets
    # one on purpose, and a control stream made before that is updated, with the change shown.
    settings = load_settings({"nats_url": private_server.url}, env={})
    async with await connect(settings, name="setup") as admin:
        control = next(s for s in default_streams(settings) if s.name == "MESHFORGE_CONTROL")
        bare = control.config()
        bare.max_consumers = None
        await admin.js.add_stream(bare)  # as an older MeshForge made it
        planned = await plan(admin.js, default_streams(settings))
        step = next(s for s in planned.steps if s.name == "MESHFORGE_CONTROL")
        assert step.details == (
            "max_consumers server default (1000 on nats-server 2.15) -> unlimited"
        )
        await apply(admin.js, planned)
        await nodes_bucket(admin.js, create=True)
        for batch in range(0, 1000, 100):
            await asyncio.gather(
                *(
                    admin.js.add_consumer(
                        "MESHFORGE_CONTROL",
                        node_consumer("big", f"n{i}", settings).config(),
                    )
                    for i in range(batch, batch + 100)
                )
            )
        async with Fleet(private_server.url, tmp_path) as fleet:
            await fleet.start("big", "n1000")
        info = await admin.js.stream_info("MESHFORGE_CONTROL")
        assert info.state.consumer_count == 1001
