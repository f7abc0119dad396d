"""ingest and audit end to end: a real server, a real SQLite store, local Spark."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import nats
import pytest
from pyspark.sql import SparkSession

from meshforge.envelope import Envelope, Outbound
from meshforge.spark.pipelines import audit, ingest
from meshforge.store import StoredOutput, open_store
from meshforge.topology.scope import Scope
from meshforge.transport.server import EmbeddedServer
from polling import wait_until

pytestmark = pytest.mark.spark

EVENTS, FAILED = "MESHFORGE_EVENTS", "MESHFORGE_FAILED"
CMD_SUBJECT = "cmd.default.demo.order.create"
EVT_SUBJECT = "evt.default.demo.order.created"
DEMO = Scope("default", "demo")  # the subjects' scope: what the runtime keys their rows by


async def _streams(url: str) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name=EVENTS, subjects=["evt.>"])
    await js.add_stream(name=FAILED, subjects=["failed.>"])
    await nc.close()


async def _publish(url: str, messages: list[tuple[str, bytes, dict[str, str]]]) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    for subject, data, headers in messages:
        await js.publish(subject, data, headers=headers)
    await nc.close()


class Scenario:
    """Commands processed by an order agent: effects in the store, events on the wire."""

    def __init__(self, store_url: str) -> None:
        self.store = open_store(store_url)
        self.wire: list[tuple[str, bytes, dict[str, str]]] = []

    def processed(self, deliveries: int = 1) -> Envelope:
        cmd = Envelope.new("order.create", {"sku": "A", "qty": 1}, source="test")
        event = cmd.child("order.created", {"order_id": str(uuid.uuid4())}, position=0)
        out = Outbound.of(EVT_SUBJECT, event)
        with self.store.transaction() as tx:
            self._begin(tx, cmd, deliveries)
            tx.effect_put("order_consumer", cmd.key, cmd.id, [StoredOutput(0, out.subject, out.msg_id, out.data, out.headers)],
                          scope=DEMO)  # fmt: skip
            tx.inbox_done(cmd.key, "order_consumer", scope=DEMO)
            tx.effect_mark_published("order_consumer", cmd.key, scope=DEMO)
        self.wire.append((out.subject, out.data, out.headers))
        return cmd

    def dead_lettered(self) -> Envelope:
        cmd = Envelope.new("order.create", {"qty": -1}, source="test")
        with self.store.transaction() as tx:
            self._begin(tx, cmd, 5)
            tx.inbox_failed(cmd.key, "order_consumer", "Unrecoverable: bad qty", scope=DEMO)
        headers = {**cmd.headers(), "Dlq-Reason": "unrecoverable", "Dlq-Error": "Unrecoverable: bad qty",
                   "Dlq-Deliveries": "5", "Dlq-Original-Subject": CMD_SUBJECT}  # fmt: skip
        self.wire.append((f"failed.{CMD_SUBJECT}", cmd.encode(), headers))
        return cmd

    def received_only(self) -> Envelope:
        cmd = Envelope.new("order.create", {"sku": "B", "qty": 1}, source="test")
        with self.store.transaction() as tx:
            self._begin(tx, cmd, 1)
        return cmd

    def duplicate_event(self, cmd: Envelope) -> None:
        stray = cmd.child("order.created", {"order_id": "again"}, position=0).with_(
            id=str(uuid.uuid4())
        )
        out = Outbound.of(EVT_SUBJECT, stray)
        self.wire.append((out.subject, out.data, out.headers))

    @staticmethod
    def _begin(tx: object, cmd: Envelope, deliveries: int) -> None:
        tx.inbox_begin(  # type: ignore[attr-defined]
            cmd.key, "order_consumer", message_id=cmd.id, type=cmd.type, subject=CMD_SUBJECT,
            stream="MESHFORGE_COMMANDS", stream_seq=1, deliveries=deliveries, headers=cmd.headers(),
            scope=DEMO,
        )  # fmt: skip


async def test_ingest_twice_lands_each_message_once(
    spark: SparkSession, private_server: EmbeddedServer, tmp_path: Path
) -> None:
    url = private_server.url
    await _streams(url)
    bodies = [
        (EVT_SUBJECT, Envelope.new("order.created", {"n": i}).encode(), {}) for i in range(40)
    ]
    await _publish(url, bodies[:25])
    first = ingest(spark, url, EVENTS, tmp_path / "events", max_messages_per_trigger=10)
    assert (first.rows, first.batches, first.end_offset) == (25, 3, {EVENTS: 26})
    await _publish(url, bodies[25:])
    second = ingest(spark, url, EVENTS, tmp_path / "events")
    assert (second.rows, second.end_offset) == (15, {EVENTS: 41})
    assert ingest(spark, url, EVENTS, tmp_path / "events").rows == 0
    landed = spark.read.parquet(str(tmp_path / "events"))
    assert sorted(r.seq for r in landed.select("seq").collect()) == list(range(1, 41))
    assert {r.type for r in landed.select("type").distinct().collect()} == {"order.created"}
    assert list((tmp_path / "events").glob("date=*/type=order.created/*.parquet"))


async def test_audit_passes_on_clean_data_and_catches_planted_faults(
    spark: SparkSession, private_server: EmbeddedServer, tmp_path: Path
) -> None:
    url, store_url = private_server.url, f"sqlite:///{tmp_path / 'store.db'}"
    await _streams(url)
    scenario = Scenario(store_url)
    commands = [scenario.processed(deliveries=1 + (i % 3 == 0)) for i in range(6)]
    scenario.dead_lettered()
    await _publish(url, scenario.wire)
    events, failed = tmp_path / "events", tmp_path / "failed"

    def run(report: Path):  # type: ignore[no-untyped-def]
        ingest(spark, url, EVENTS, events)
        ingest(spark, url, FAILED, failed)
        return audit(spark, str(events), report, failed=str(failed), store_url=store_url)

    clean = run(tmp_path / "clean")
    counts = clean.findings["counts"]
    assert clean.ok, json.dumps(clean.findings["violations"], default=str)
    assert (counts["events"], counts["commands"], counts["effects"]) == (6, 7, 6)
    assert clean.findings["dead_letters"]["by_reason"] == {"unrecoverable": 1}
    assert clean.findings["dead_letters"]["by_subject"] == {CMD_SUBJECT: 1}
    assert (
        clean.findings["redeliveries"]["messages_redelivered"] == 3
    )  # two of six + the dead letter
    assert clean.findings["latency_ms"]["count"] == 6 and clean.findings["latency_ms"]["p50"] >= 0
    assert json.loads(clean.json_path.read_text())["ok"] is True
    assert "Exactly-once holds" in clean.html_path.read_text()

    scenario.wire.clear()
    scenario.duplicate_event(commands[2])
    lost = scenario.received_only()
    await _publish(url, scenario.wire)
    bad = run(tmp_path / "bad")
    assert not bad.ok
    dups = bad.findings["violations"]["duplicate_effects"]
    assert [d["causation_id"] for d in dups] == [commands[2].id]
    assert [m["command_id"] for m in bad.findings["violations"]["missing_effects"]] == [lost.id]
    assert bad.findings["counts"]["lost_outputs"] == 0
    html = bad.html_path.read_text()
    assert "Exactly-once VIOLATED" in html and commands[2].id in html and "<svg" in html
    assert "http://" not in html and "https://" not in html
    scenario.store.close()


async def test_audit_counts_an_output_stored_twice_after_the_duplicate_window(
    spark: SparkSession, private_server: EmbeddedServer, tmp_path: Path
) -> None:
    """The same event (same id) published again once the server's duplicate window has
    passed is a second stream message: the audit counts messages, so it is a violation."""
    url, store_url = private_server.url, f"sqlite:///{tmp_path / 'store.db'}"
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(
        name=EVENTS, subjects=["evt.>"], duplicate_window=0.2
    )  # minutes, made short
    scenario = Scenario(store_url)
    commands = [scenario.processed() for _ in range(3)]
    for subject, data, headers in scenario.wire:
        await js.publish(subject, data, headers=headers)
    subject, data, headers = scenario.wire[1]

    async def stored_again() -> bool:
        ack = await js.publish(subject, data, headers=headers)
        return not ack.duplicate  # inside the window the server drops it

    await wait_until(
        stored_again, timeout=10, what="the re-publish stored after the duplicate window"
    )
    await nc.close()
    events = tmp_path / "events"
    assert ingest(spark, url, EVENTS, events).rows == 4
    result = audit(spark, str(events), tmp_path / "report", store_url=store_url)
    assert not result.ok
    counts, violations = result.findings["counts"], result.findings["violations"]
    assert (
        counts["events"],
        counts["event_ids"],
        counts["duplicate_effects"],
        counts["doubled_outputs"],
    ) == (4, 3, 0, 1)
    [doubled] = violations["doubled_outputs"]
    assert (doubled["id"], doubled["causation_id"], doubled["copies"]) == (
        headers["Nats-Msg-Id"],
        commands[1].id,
        2,
    )
    assert doubled["seqs"] == [2, 4]
    assert "Exactly-once VIOLATED" in result.html_path.read_text()
    scenario.store.close()


def test_store_source_reads_every_table(spark: SparkSession, tmp_path: Path) -> None:
    from meshforge.store import NewEvent

    url = f"sqlite:///{tmp_path / 'store.db'}"
    scenario = Scenario(url)
    cmd = scenario.processed(deliveries=2)
    with scenario.store.transaction() as tx:
        for agent, n in (("order", 3), ("inventory", 2)):
            tx.events_append(agent, [NewEvent(f"{agent}-{i}", f"{agent}.x", None, cmd.id, cmd.key, b"{}", "t") for i in range(n)],
                             scope=DEMO)  # fmt: skip
        # Another tenant's log of the same agent, with the same event id: its own partition.
        tx.events_append("order", [NewEvent("order-0", "order.x", None, cmd.id, cmd.key, b"{}", "t")],
                         scope=Scope("tenantB", "demo"))  # fmt: skip
    scenario.store.close()

    def table(name: str):  # type: ignore[no-untyped-def]
        return spark.read.format("meshforge_store").option("url", url).option("table", name).load()

    events = table("events")
    assert events.rdd.getNumPartitions() == 3  # one per tenant, namespace and agent
    assert sorted((r.tenant, r.namespace, r.agent, r.position) for r in events.collect()) == [
        ("default", "demo", "inventory", 1), ("default", "demo", "inventory", 2),
        ("default", "demo", "order", 1), ("default", "demo", "order", 2),
        ("default", "demo", "order", 3), ("tenantB", "demo", "order", 1),
    ]  # fmt: skip
    effect = table("effects").collect()[0]
    assert (effect.command_id, effect.outputs, effect.published_at is not None) == (cmd.id, 1, True)
    assert (effect.tenant, effect.namespace) == ("default", "demo")
    output = table("outputs").collect()[0]
    assert output.subject == EVT_SUBJECT and output.headers["Causation-Id"] == cmd.id
    inbox = table("inbox").collect()[0]
    assert (inbox.message_id, inbox.status, inbox.deliveries) == (cmd.id, "processed", 2)
    assert (inbox.tenant, inbox.namespace) == ("default", "demo")
    with pytest.raises(Exception, match="no store at sqlite:///"):
        spark.read.format("meshforge_store").option("url", "sqlite:///nowhere/x.db").option(
            "table", "inbox"
        ).load().count()
