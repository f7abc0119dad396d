"""A local three-node cluster: `meshforge server --cluster 3`, replicas 3, and a leader killed under load."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from meshforge.cli.demo_support import AgentProcess, StreamMessage, meshforge_command, read_stream
from meshforge.config import load_settings
from meshforge.envelope import Envelope, Outbound
from meshforge.errors import TopologyError
from meshforge.publish.publisher import Publisher
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_EVENTS, STREAM_FAILED
from meshforge.transport.cluster import EmbeddedCluster
from meshforge.transport.connection import connect
from polling import wait_until, wait_until_sync

pytestmark = pytest.mark.slow

ORDERS = 400
BACKLOG = 60
SUBJECT = "cmd.default.demo.order.create"


def _server(home: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "MESHFORGE_HOME": str(home)}
    return subprocess.Popen(
        [sys.executable, "-m", "meshforge", "server", *args], env=env, cwd=home.parent,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_meshforge_server_cluster_runs_three_routed_jetstream_nodes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    marker = home / "server.json"
    first = _server(home, "--cluster", "3")
    try:
        wait_until_sync(marker.exists, 30, "the cluster's server.json")
        urls = json.loads(marker.read_text())["url"].split(",")
        assert len(urls) == 3 and all(u.startswith("nats://127.0.0.1:") for u in urls)

        async def replicated() -> tuple[int, list[str]]:
            conn = await connect(load_settings({"nats_url": ",".join(urls)}, env={}))
            try:
                js = conn.js
                await js.add_stream(name="R3", subjects=["r3.>"], num_replicas=3)

                async def led() -> bool:  # a new replicated stream elects its leader first
                    try:
                        found = await js.stream_info("R3")
                    except Exception:  # not answering until it has one
                        return False
                    return found.cluster is not None and bool(found.cluster.leader)

                await wait_until(led, 20, "the new stream's leader")
                await js.publish("r3.a", b"x")
                info = await js.stream_info("R3")
                assert info.cluster is not None
                peers = [info.cluster.leader or ""] + [p.name for p in info.cluster.replicas or []]
                return info.config.num_replicas or 0, sorted(peers)
            finally:
                await conn.close()

        replicas, peers = asyncio.run(replicated())
        assert (replicas, peers) == (3, ["meshforge-1", "meshforge-2", "meshforge-3"])

        # the same data directory cannot be served twice, by a cluster or a single server
        for args in (("--cluster", "3"), ()):
            second = _server(home, *args)
            try:
                _, err = second.communicate(timeout=30)
            finally:
                if second.poll() is None:
                    second.send_signal(signal.SIGTERM)
                    second.communicate(timeout=30)
            assert second.returncode == 1 and err.count("\n") == 1, err
            assert "is already in use by pid" in err and ",".join(urls) in err, err
        assert json.loads(marker.read_text())["url"] == ",".join(urls)
    finally:
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=30)
    assert first.returncode == 0, err
    assert "JetStream meta leader meshforge-" in out
    for name, url in zip(("meshforge-1", "meshforge-2", "meshforge-3"), urls, strict=True):
        assert f"{name}: {url}" in out
    assert f"export MESHFORGE_NATS_URL={','.join(urls)}" in out
    assert not marker.exists()


async def _leader(js: JetStreamContext, stream: str) -> str | None:
    try:
        info = await js.stream_info(stream)
    except Exception:  # no leader, or the node asked is down: not yet
        return None
    return info.cluster.leader if info.cluster else None


async def test_killing_the_commands_leader_under_load_loses_and_doubles_nothing(
    tmp_path: Path,
) -> None:
    cluster = EmbeddedCluster(3, data_dir=tmp_path / "cluster")
    await asyncio.to_thread(cluster.start)
    worker = AgentProcess(
        ["meshforge.demo:OrderAgent", "meshforge.demo:InventoryAgent"],
        f"sqlite:///{tmp_path / 'store.db'}", cluster.url, tmp_path / "worker.log",
        env={"MESHFORGE_REPLICAS": "3", "MESHFORGE_PUBLISH_ATTEMPTS": "20"},
    )  # fmt: skip
    conn = None
    loading: asyncio.Task[None] | None = None
    try:
        # provision as an operator would: replicas 3 for the streams and the consumers
        env = {**os.environ, "MESHFORGE_REPLICAS": "3"}
        done = await asyncio.to_thread(
            subprocess.run,
            meshforge_command("provision", "--nats-url", cluster.url, "--agent", "order", "--agent", "inventory"),
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        settings = load_settings(
            {"nats_url": cluster.url, "replicas": 3, "publish_attempts": 20, "publish_timeout": 2},
            env={},
        )
        conn = await connect(settings, name="cluster-test")
        js = conn.js
        for stream in (STREAM_COMMANDS, STREAM_EVENTS, STREAM_FAILED):
            assert (await js.stream_info(stream)).config.num_replicas == 3
        for durable in ("order_consumer", "inventory_consumer"):
            info = await js.consumer_info(STREAM_COMMANDS, durable)
            assert (
                info.config.num_replicas == 3
                and info.cluster
                and len(info.cluster.replicas or []) == 2
            )

        worker.start()
        publisher = Publisher(js, settings)
        await publisher.publish(
            "cmd.default.demo.inventory.create",
            Envelope.new("inventory.create", {"sku": "S", "qty": 10 * ORDERS}, source="test"),
        )
        orders = [
            Envelope.new(
                "order.create", {"order_id": f"o-{i}", "sku": "S", "qty": 1}, source="test"
            )
            for i in range(ORDERS)
        ]

        seen = [0]

        async def events() -> int:
            """Events stored so far (the last count while the cluster cannot answer)."""
            with contextlib.suppress(Exception):
                seen[0] = int((await js.stream_info(STREAM_EVENTS)).state.messages)
            return seen[0]

        async def load() -> None:
            """Orders in chunks, at most BACKLOG ahead of the worker: a steady load throughout."""
            for start in range(0, ORDERS, 20):

                async def room(start: int = start) -> bool:
                    return start - (await events() - 1) // 2 < BACKLOG

                await wait_until(room, 60, "the worker to keep up")
                items = [Outbound.of(SUBJECT, env) for env in orders[start : start + 20]]
                await publisher.publish_many(items, max_in_flight=20)

        loading = asyncio.create_task(load())

        async def processed_some() -> bool:
            return await events() > 40

        await wait_until(processed_some, 30, "the worker to process the first orders")
        leader = await _leader(js, STREAM_COMMANDS)
        assert leader is not None
        killed = cluster.node(leader)
        killed.kill()  # SIGKILL, mid-load
        assert not loading.done(), "the load ended before the leader was killed: raise ORDERS"

        async def new_leader() -> bool:
            return (await _leader(js, STREAM_COMMANDS)) not in (None, leader)

        await wait_until(new_leader, 30, "a new MESHFORGE_COMMANDS leader")
        await asyncio.to_thread(killed.start)
        await asyncio.wait_for(loading, 60)

        async def all_applied() -> bool:
            return await events() >= 1 + 2 * ORDERS

        await wait_until(all_applied, 60, f"{2 * ORDERS} order events")

        async def caught_up() -> bool:
            try:
                info = await js.stream_info(STREAM_COMMANDS)
            except Exception:  # the node asked is still catching up: not yet
                return False
            peers = info.cluster.replicas if info.cluster else None
            return bool(peers) and all(p.current for p in peers or []) and info.state.messages == 0

        await wait_until(
            caught_up, 30, "the restarted node to catch up and the work queue to drain"
        )
        assert worker.alive, (tmp_path / "worker.log").read_text()[-3000:]

        expected = collections.Counter({"order.created": 1, "inventory.reserved": 1})
        stored: list[StreamMessage] = []
        per_order: dict[str, collections.Counter[str]] = {}

        async def read_all() -> bool:
            # A read served by a replica still catching up can miss the newest events: read again.
            try:
                stored[:] = await read_stream(js, STREAM_EVENTS, "evt.>")
            except Exception:  # nats.errors.TimeoutError while the replica catches up: again
                return False
            per_order.clear()
            for message in stored:
                env = message.envelope()
                assert env is not None
                if "order_id" in env.payload:
                    per_order.setdefault(env.payload["order_id"], collections.Counter())[
                        env.type
                    ] += 1
            return len(stored) >= 1 + 2 * ORDERS

        with contextlib.suppress(AssertionError):
            await wait_until(read_all, 20, "every event to be readable")
        wrong = {oid: dict(c) for oid, c in per_order.items() if c != expected}
        assert not wrong, f"orders not applied exactly once: {dict(list(wrong.items())[:5])}"
        assert set(per_order) == {f"o-{i}" for i in range(ORDERS)}
        assert len({m.headers.get("Nats-Msg-Id") for m in stored}) == len(stored) == 1 + 2 * ORDERS
        assert (await js.stream_info(STREAM_FAILED)).state.messages == 0
    finally:
        if loading is not None and not loading.done():
            loading.cancel()
        worker.stop(20)
        if conn is not None:
            await conn.close()
        await asyncio.to_thread(cluster.close)


async def test_consumer_replicas_follow_the_streams_or_the_setting(tmp_path: Path) -> None:
    from meshforge.topology.provision import ensure, plan
    from meshforge.topology.specs import agent_consumer, default_streams

    async with EmbeddedCluster(3, data_dir=tmp_path / "cluster") as cluster:
        conn = await connect(load_settings({"nats_url": cluster.url}, env={}))
        try:
            js = conn.js

            async def provision(**values: object) -> list[str]:
                settings = load_settings(values, env={})
                streams, consumers = default_streams(settings), [agent_consumer("order", settings)]
                planned = await plan(js, streams, consumers)
                await ensure(js, streams, consumers)
                return [
                    f"{s.action} {s.name} {s.details}".strip()
                    for s in planned.steps
                    if s.kind == "consumer"
                ]

            async def consumer() -> tuple[int, int]:
                info = await js.consumer_info(STREAM_COMMANDS, "order_consumer")
                peers = 1 + len(info.cluster.replicas or []) if info.cluster else 0
                return info.config.num_replicas or 0, peers

            # 0: inherit the stream's replicas (the server's own rule)
            await provision(replicas=3, consumer_replicas=0)
            assert await consumer() == (0, 3)
            # the default is the streams' replicas: 3, which is what "inherit" means here
            assert await provision(replicas=3) == [f"unchanged {STREAM_COMMANDS}/order_consumer"]
            # a work-queue stream's consumers must have its replicas: refused before the server does
            with pytest.raises(
                TopologyError,
                match=r"replicas 1 differ from stream MESHFORGE_COMMANDS's 3.*consumer_replicas to 3 or 0",
            ):
                await provision(replicas=3, consumer_replicas=1)
            assert await consumer() == (0, 3)
            # explicit replicas equal to the stream's are what the default sets on creation
            await js.delete_consumer(STREAM_COMMANDS, "order_consumer")
            [created] = await provision(replicas=3)
            assert created.startswith(
                f"create {STREAM_COMMANDS}/order_consumer"
            ) and created.endswith("; replicas 3")
            assert await consumer() == (3, 3)
            assert await provision(replicas=3, consumer_replicas=0) == [
                f"unchanged {STREAM_COMMANDS}/order_consumer"
            ]
        finally:
            await conn.close()


def _route_port(cluster: EmbeddedCluster, index: int) -> int:
    args = cluster.nodes[index].extra_args
    return int(args[args.index("--cluster") + 1].rsplit(":", 1)[1])


def test_a_route_port_taken_before_its_node_binds_it_is_picked_again(tmp_path: Path) -> None:
    cluster = EmbeddedCluster(3, data_dir=tmp_path / "cluster")
    taken = _route_port(cluster, 1)
    with socket.socket() as squatter:  # another process wins the race for node 2's route port
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            cluster.start()
            assert _route_port(cluster, 1) != taken
            assert cluster.meta_leader() in cluster.names
        finally:
            cluster.close()
    log = (tmp_path / "cluster" / "meshforge-2" / "nats-server.log").read_text()
    assert "address already in use" in log, "the first start did not fail on the taken port"
