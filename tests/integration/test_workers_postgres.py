"""Several workers of one agent sharing its durable consumer on PostgreSQL: still one effect each."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import pytest
from test_engine_support import (
    SCOPE,
    consumer_idle,
    events_of,
    ledger_agent,
    open_conn,
    settings_for,
    wait_until,
)

from meshforge.cli.demo_support import AgentProcess, read_stream
from meshforge.consume.decisions import Action, Delivery
from meshforge.demo import InventoryAgent, OrderAgent
from meshforge.envelope import Envelope, Outbound
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.runtime.agent import derive_uuid
from meshforge.runtime.engine import Engine
from meshforge.runtime.replay import replay
from meshforge.store import open_store
from meshforge.topology.scope import Scope
from meshforge.topology.subjects import STREAM_FAILED
from meshforge.transport.server import EmbeddedServer

pytestmark = pytest.mark.postgres
DEMO = Scope("default", "demo")


# The drain's bound is against a hang: what this test proves is one effect a command.
# After a kill, the inventory's six resources can fall into a convoy: their commands are
# spread over the three workers, each holds what an earlier command of its resource, away
# at another worker or nak'ed, still blocks, and a resource advances one command a nak
# delay (1-3 commands a second a worker, measured, where the run is usually done in
# 10-25 s). Partitions (docs/AGENTS.md) are what keep a hot resource on one worker.
@pytest.mark.slow
@pytest.mark.timeout(480)
async def test_three_workers_one_killed_give_exactly_one_effect_per_command(
    private_server: EmbeddedServer, own_pg: str, tmp_path: Path
) -> None:
    env = {
        "MESHFORGE_BATCH_SIZE": "8",
        "MESHFORGE_BACKOFF": "0.5s,1s",
        "MESHFORGE_MAX_DELIVER": "20",
        "MESHFORGE_LOG_LEVEL": "INFO",
    }
    specs = ["meshforge.demo:OrderAgent", "meshforge.demo:InventoryAgent"]
    workers = [
        AgentProcess(specs, own_pg, private_server.url, tmp_path / f"worker{i}.log", env=env)
        for i in range(3)
    ]
    settings = settings_for(private_server.url, own_pg)
    conn = await open_conn(settings)
    rng = random.Random(7)
    try:
        publisher = Publisher(conn.js)
        skus = [f"S{i}" for i in range(6)]
        stock = [Envelope.new("inventory.create", {"sku": s, "qty": 100_000}) for s in skus]
        await publisher.publish_many(
            [Outbound.of("cmd.default.demo.inventory.create", e) for e in stock]
        )
        orders = [Envelope.new("order.create", {"sku": rng.choice(skus), "qty": rng.randint(1, 3)})
                  for _ in range(400)]  # fmt: skip
        # Re-sends of some requests: new message ids, same Idempotency-Key.
        resent = [o.with_(id=str(uuid.uuid4())) for o in rng.sample(orders, 60)]
        for w in workers:
            w.start()

        # Several workers apply one resource's commands in delivery order only when they
        # are not in flight together: the stock exists before the first order reserves it.
        async def stocked() -> bool:
            return len(await events_of(conn, "inventory")) >= len(skus)

        await wait_until(stocked, within=60, what="the stock created")
        subject = "cmd.default.demo.order.create"

        async def left() -> tuple[int, int]:
            """The order commands not yet acknowledged, and those of them in a worker's hands."""
            info = await conn.js.consumer_info("MESHFORGE_COMMANDS", "order_consumer")
            return info.num_pending + info.num_ack_pending, info.num_ack_pending

        def running(worker: AgentProcess) -> bool:
            """Whether the worker's latest start got as far as consuming."""
            return worker.log_path.read_text().count("running order, inventory") >= worker.starts

        def more_orders(n: int) -> list[Outbound]:
            wave = [Envelope.new("order.create", {"sku": rng.choice(skus), "qty": 1})
                    for _ in range(n)]  # fmt: skip
            orders.extend(wave)
            return [Outbound.of(subject, e) for e in wave]

        async def kill_mid_work(worker: AgentProcess) -> None:
            """Kill ``worker`` once it consumes and orders are in a worker's hands with
            others still to do (a worker killed while still starting would kill nothing in
            flight). On a loaded machine the other workers may finish everything while this
            one starts: another wave of orders goes out then, and the wait goes on."""

            async def consuming() -> bool:
                return running(worker)

            await wait_until(consuming, within=60, what="the worker running")
            deadline = time.monotonic() + 60
            while True:
                remaining, in_hand = await left()
                if remaining > in_hand > 0:
                    break
                if remaining == 0:
                    await publisher.publish_many(more_orders(40))
                assert time.monotonic() < deadline, "no orders in flight with others to do"
                await asyncio.sleep(0.01)
            worker.kill()
            assert (await left())[0] > 0, "the work was all done before the kill"
            worker.start()

        await publisher.publish_many([Outbound.of(subject, e) for e in orders[:200]])
        await kill_mid_work(workers[0])
        await publisher.publish_many([Outbound.of(subject, e) for e in orders[200:400] + resent])
        await kill_mid_work(workers[1])

        async def idle() -> bool:
            return await consumer_idle(conn, "order") and await consumer_idle(conn, "inventory")

        await wait_until(idle, within=300, what="both agents idle")

        async def all_running() -> bool:
            # A restarted worker may still be starting when the work is done: a SIGTERM
            # before its signal handlers exist would end it with -15, not a graceful stop.
            return all(running(w) for w in workers)

        await wait_until(all_running, within=30, what="every worker running")
        for w in workers:
            assert w.stop(20) == 0, w.log_path.read_text()[-2000:]

        events = [
            m.envelope()
            for m in await events_of(conn, "order") + await events_of(conn, "inventory")
        ]
        created: dict[str, set[str]] = defaultdict(set)
        reserved: dict[str, set[str]] = defaultdict(set)
        for e in events:
            assert e is not None
            if e.type == "order.created":
                created[e.payload["order_id"]].add(e.id)
            elif e.type == "inventory.reserved":
                reserved[e.payload["order_id"]].add(e.id)
        expected = {derive_uuid("order", o.key) for o in orders}
        assert set(created) == expected and all(len(ids) == 1 for ids in created.values())
        assert set(reserved) == expected and all(len(ids) == 1 for ids in reserved.values())
        assert not await read_stream(conn.js, STREAM_FAILED, "failed.>")

        store = await asyncio.to_thread(open_store, own_pg)
        try:
            for name, agent in (("order", OrderAgent()), ("inventory", InventoryAgent())):
                result = await asyncio.to_thread(replay, store, name, agent)
                assert result.consistent, result.mismatched
            logged = list(store.events_read("order", scope=DEMO))
            assert len(logged) == len(orders) and len({e.key for e in logged}) == len(orders)
            states = (await asyncio.to_thread(replay, store, "inventory", InventoryAgent())).states
            by_sku: dict[str, int] = defaultdict(int)
            for o in orders:
                by_sku[o.payload["sku"]] += o.payload["qty"]
            assert {s: states[s].reserved for s in skus} == {s: by_sku[s] for s in skus}
        finally:
            store.close()
    finally:
        for w in workers:
            w.kill()
        await conn.close()


async def test_same_key_raced_by_two_engines_commits_one_effect(
    private_server: EmbeddedServer, own_pg: str
) -> None:
    agent_a = ledger_agent()
    agent_b = ledger_agent(agent_a.name)
    settings = settings_for(private_server.url, own_pg)
    conn = await open_conn(settings)
    stores = [await asyncio.to_thread(open_store, own_pg) for _ in range(2)]
    publisher = Publisher(conn.js)
    engines = [Engine(a, s, publisher, settings=settings, metrics=Metrics())
               for a, s in zip((agent_a, agent_b), stores, strict=True)]  # fmt: skip
    try:
        # One request key, two different resources: the resource locks do not serialise
        # them, so the effect's unique key must.
        key = str(uuid.uuid4())
        subject = f"cmd.default.test.{agent_a.name}.credit"
        first = Envelope.new(f"{agent_a.name}.credit", {"account": "x", "amount": 1, "mode": "slow",
                             "seconds": 0.3}, idempotency_key=key)  # fmt: skip
        second = first.with_(id=str(uuid.uuid4()), payload={**first.payload, "account": "y"})

        def delivery(env: Envelope, seq: int) -> Delivery:
            return Delivery(msg=None, subject=subject, data=env.encode(), headers=env.headers(),  # type: ignore[arg-type]
                            stream="MESHFORGE_COMMANDS", seq=seq, num_delivered=1,
                            timestamp=datetime.now(UTC), envelope=env)  # fmt: skip

        a, b = await asyncio.gather(
            engines[0].handle([delivery(first, 1)]), engines[1].handle([delivery(second, 2)])
        )
        assert a[0].action is Action.ACK and b[0].action is Action.ACK
        skipped = [
            e.metrics.duplicates_skipped.labels(consumer=e.consumer)._value.get() for e in engines
        ]
        assert sorted(skipped) == [0, 1]  # the loser found the winner's effect and re-published it
        logged = list(stores[0].events_read(agent_a.name, scope=SCOPE))
        assert len(logged) == 1
        published = {m.envelope().id for m in await events_of(conn, agent_a.name)}  # type: ignore[union-attr]
        assert published == {logged[0].event_id}
        with stores[0].transaction() as tx:
            assert (tx.state_get(agent_a.name, "x", scope=SCOPE) is None) != (
                tx.state_get(agent_a.name, "y", scope=SCOPE) is None
            )
    finally:
        for engine in engines:
            engine.close()
        for store in stores:
            store.close()
        await conn.close()
