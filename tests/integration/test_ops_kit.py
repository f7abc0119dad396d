"""The operations kit: the alert rules and the dashboard are well formed, every series
they name is exported by a running worker, relay or node, and the polled gauges are right."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from ops_support import Child, parse_metrics, scrape, status
from test_engine_support import settings_for

from meshforge.control.client import ControlClient
from meshforge.control.jobs import JobSpec, JobStore
from meshforge.control.rollout import JobController
from meshforge.demo import OrderAgent
from meshforge.envelope import Envelope
from meshforge.ops.observability import Metrics, serve_http
from meshforge.ops.probes import Probes
from meshforge.publish.outbox import OutboxRelay, enqueue
from meshforge.publish.publisher import Publisher
from meshforge.runtime.worker import Worker
from meshforge.store import open_store
from meshforge.topology.provision import ensure
from meshforge.topology.specs import ConsumerSpec, default_streams
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.connection import connect
from polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "meshforge.json"
RUNBOOK = ROOT / "docs" / "RUNBOOK.md"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
# Prometheus makes `up` itself from each scrape; every other series must be ours.
PROMETHEUS_OWN = {"up"}
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "le",
}
_DURATION = re.compile(r"^\d+[smhdwy]$")


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"} and isinstance(doc["groups"], list) and doc["groups"]
    out = []
    for group in doc["groups"]:
        assert isinstance(group["name"], str) and set(group) <= {"name", "interval", "rules"}
        assert isinstance(group["rules"], list) and group["rules"]
        out += group["rules"]
    return out


def series_in(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label values, ranges and functions left out)."""
    assert _balanced(expr), f"unbalanced brackets in {expr!r}"
    bare = re.sub(r'"[^"]*"', '""', expr)  # no names inside strings
    bare = re.sub(r"\{[^}]*\}", "{}", bare)  # nor in label matchers
    bare = re.sub(r"\[[^\]]*\]", "[]", bare)  # nor in ranges
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    names = {m for m in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare)}
    functions = set(re.findall(r"([a-zA-Z_]+)\s*\(", bare))
    return {n for n in names - functions - _KEYWORDS if not n[0].isdigit()}


def _balanced(expr: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in re.sub(r'"[^"]*"', "", expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert dash["uid"] == "meshforge" and len(exprs) >= 20
    return exprs


def test_alert_rules_are_valid_prometheus_rules() -> None:
    names = []
    for rule in rules():
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"MeshForge[A-Z][A-Za-z]+", rule["alert"])
        assert isinstance(rule["expr"], str) and series_in(rule["expr"]), rule["alert"]
        assert _DURATION.match(rule["for"]), rule["for"]
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"])
        assert rule["annotations"]["runbook_url"] == f"docs/RUNBOOK.md#{rule['alert'].lower()}"
        assert re.search(r"[<>]=?\s*[\d.]+|==\s*0", rule["expr"]), f"{rule['alert']}: no threshold"
        names.append(rule["alert"])
    assert len(set(names)) == len(names)
    wanted = {"DeadLettersRising", "RedeliveriesHigh", "MaxDeliverExhausted", "ConsumerLag",
              "OutboxBacklog", "PublishFailures", "NodeOffline", "WorkerDown"}  # fmt: skip
    assert {f"MeshForge{w}" for w in wanted} <= set(names)
    runbook = RUNBOOK.read_text()
    operations = OPERATIONS.read_text()
    for name in names:  # a runbook section each, and the alert list in OPERATIONS.md
        assert re.search(rf"^## {name}$", runbook, re.M), f"RUNBOOK.md has no section {name}"
        assert f"RUNBOOK.md#{name.lower()}" in operations, f"OPERATIONS.md does not list {name}"


def test_the_promql_check_finds_names() -> None:
    assert series_in(
        'sum by (job, consumer) (increase(meshforge_acked_total{job="x"}[10m])) > 0'
    ) == {"meshforge_acked_total"}
    assert series_in('up{job="meshforge-node"} == 0 or meshforge_ready{job="n"} == 0') == {
        "up",
        "meshforge_ready",
    }
    assert not _balanced("sum(rate(x[5m])")


@pytest.fixture
async def exported(nats_url: str, tmp_path: Path) -> dict[str, dict[Any, float]]:
    """Everything a worker, a node and an outbox relay export, after a little work each."""
    settings = settings_for(nats_url, f"sqlite:///{tmp_path / 'worker.db'}", metrics_port=0)
    worker = Worker([OrderAgent()], settings, probe_interval=0.2)
    task = asyncio.create_task(worker.run())
    node = Child(
        ["node", "ops", "n1", "--store", f"sqlite:///{tmp_path / 'node.db'}", "--nats-url", nats_url,
         "--metrics-port", "0"],
        tmp_path / "node.log",
    )  # fmt: skip
    conn = await connect(settings)
    store = await asyncio.to_thread(open_store, f"sqlite:///{tmp_path / 'relay.db'}")
    relay_metrics = Metrics()
    relay = OutboxRelay(store, Publisher(conn.js, settings, relay_metrics), idle=0.05)
    relaying = asyncio.create_task(relay.run())
    endpoint = await serve_http("127.0.0.1", 0, relay_metrics, conn.health, lambda: True)
    try:
        await asyncio.wait_for(worker.ready.wait(), 20)
        assert worker.endpoint is not None
        wport = worker.endpoint.port
        pub = Publisher(conn.js, settings)
        await pub.publish(
            "cmd.default.demo.order.create", Envelope.new("order.create", {"sku": "S", "qty": 1})
        )

        def processed() -> bool:
            rows = scrape(wport).get("meshforge_effects_rows", {})
            return rows.get((("status", "published"),), 0) >= 1

        await wait_until(lambda: asyncio.to_thread(processed), 20, "the effects count")  # type: ignore[arg-type,return-value]
        port = await node.metrics_port()
        await wait_until(lambda: _up(port), 30, "the node's /readyz")
        _, reply = await ControlClient(conn, settings=settings).request(
            "ops", "n1", "echo", {"a": 1}, timeout=20
        )
        assert reply is not None and reply.ok
        await asyncio.to_thread(
            store.run,
            lambda tx: enqueue(tx, "evt.default.ops.relay.sent", Envelope.new("relay.sent", {})),
        )
        relay.notify()
        await wait_until(lambda: relay.sent_total >= 1, 20, "the relay to publish")
        await relay.depth()
        # A job controller's series: a job past its deadline (it ends EXPIRED, nothing sent).
        jobs = await JobStore.open(conn.js)
        job = f"ops{uuid.uuid4().hex[:8]}"
        await jobs.create(
            JobSpec(job, "echo", {}, targets=[("ops", "gone")], deadline="2020-01-01T00:00:00Z")
        )
        job_metrics = Metrics()
        async with asyncio.timeout(60):  # a controller that never ends fails here, named
            assert await JobController(conn, jobs, job, metrics=job_metrics).run() == "completed"
        found: dict[str, dict[Any, float]] = {}
        worker_metrics, node_metrics, relay_metrics_seen = [
            await asyncio.to_thread(scrape, p) for p in (wport, port, endpoint.port)
        ]
        controller = parse_metrics(job_metrics.render().decode())
        for source in (worker_metrics, node_metrics, relay_metrics_seen, controller):
            for name, samples in source.items():
                found.setdefault(name, {}).update(samples)
        return {"all": found, "worker": worker_metrics, "node": node_metrics}  # type: ignore[dict-item]
    finally:
        await relay.stop()
        await relaying
        await endpoint.close()
        await worker.stop()
        await task
        await conn.close()
        await asyncio.to_thread(store.close)
        assert node.stop() == 0, node.output()


async def _up(port: int) -> bool:
    return await asyncio.to_thread(status, port, "/readyz") == 200


async def test_every_series_an_alert_or_panel_names_is_exported(exported: dict[str, Any]) -> None:
    found = exported["all"]
    named = set()
    for rule in rules():
        named |= series_in(rule["expr"])
    for expr in dashboard_exprs():
        named |= series_in(expr)
    missing = sorted(n for n in named - PROMETHEUS_OWN if n not in found)
    assert not missing, f"named by alerts or panels but exported by nobody: {missing}"
    # ... and the table in OPERATIONS.md lists every series we export.
    ours = {
        re.sub(r"_(total|bucket|count|sum|created)$", "", n)
        for n in found
        if n.startswith("meshforge_")
    }
    table = OPERATIONS.read_text()
    assert not sorted(n for n in ours if f"`{n}" not in table), "OPERATIONS.md lacks some series"


async def test_node_metrics_count_commands_replies_and_epoch(exported: dict[str, Any]) -> None:
    node = exported["node"]
    labels = (("command", "echo"), ("node", "n1"), ("site", "ops"))
    assert node["meshforge_node_commands_total"][labels] == 1
    assert (
        node["meshforge_node_replies_total"][(("node", "n1"), ("site", "ops"), ("status", "ok"))]
        == 1
    )
    assert node["meshforge_node_epoch"][(("node", "n1"), ("site", "ops"))] >= 1
    assert node["meshforge_ready"] == {(): 1.0} and node["meshforge_nats_connected"] == {(): 1.0}
    assert (("consumer", "node_ops_n1"), ("stream", "MESHFORGE_CONTROL")) in node[
        "meshforge_consumer_pending"
    ]
    worker = exported["worker"]
    # Series exist at 0 before the first dead letter, so increase() sees the first one.
    assert (
        worker["meshforge_dead_lettered_total"][
            (("consumer", "order_consumer"), ("reason", "malformed"))
        ]
        == 0
    )


async def test_probes_read_lag_and_ack_pending_from_the_server(conn: Any, sqlite_url: str) -> None:
    settings = settings_for("nats://unused", sqlite_url)
    spec = ConsumerSpec(STREAM_COMMANDS, "lagprobe", "cmd.default.ops.lagprobe.>")
    await ensure(conn.js, default_streams(settings), [spec])
    for i in range(5):
        await conn.js.publish("cmd.default.ops.lagprobe.do", f"{i}".encode())
    metrics = Metrics()
    store = await asyncio.to_thread(open_store, sqlite_url)
    probes = Probes(
        conn.js, metrics, [(STREAM_COMMANDS, "lagprobe"), (STREAM_COMMANDS, "ghost")], store=store
    )
    try:
        await probes.sample()
        got = parse_metrics(metrics.render().decode())
        key = (("consumer", "lagprobe"), ("stream", STREAM_COMMANDS))
        assert (
            got["meshforge_consumer_pending"][key] == 5
            and got["meshforge_consumer_ack_pending"][key] == 0
        )
        sub = await conn.js.pull_subscribe(
            "cmd.default.ops.lagprobe.>", durable="lagprobe", stream=STREAM_COMMANDS
        )
        await sub.fetch(2, timeout=5)  # delivered, not acked
        await probes.sample()
        got = parse_metrics(metrics.render().decode())
        assert (
            got["meshforge_consumer_pending"][key] == 3
            and got["meshforge_consumer_ack_pending"][key] == 2
        )
        assert (
            got["meshforge_inbox_rows"] == {} and got["meshforge_effects_rows"] == {}
        )  # empty store
    finally:
        await asyncio.to_thread(store.close)
        await conn.js.delete_consumer(STREAM_COMMANDS, "lagprobe")
