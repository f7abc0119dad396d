"""A worker's partitions share their lane's room for held commands.

Each partition durable used to hold the engine's whole ``max_held``: a worker with 16
partitions on 2 lanes held 8 times what a lane's transactions reach within a first ack
wait. Every held command was kept alive with ``in_progress`` (7 beats a command in the
partition benchmark, 431,611 for 60,000 commands), and a pause of the machine let the
server hand thousands out again (a drain of 13 s took 65-108 s).
"""

from __future__ import annotations

import asyncio

from test_engine_support import (
    events_of,
    ledger_agent,
    open_conn,
    open_store_async,
    running,
    settings_for,
    wait_until,
)

from meshforge.envelope import Envelope, Outbound
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.topology.partitions import partitioned

COMMANDS, RESOURCES, PARTITIONS = 1_600, 160, 8


async def test_a_lanes_partitions_share_its_room_for_held_commands(
    nats_url: str, sqlite_url: str
) -> None:
    agent = ledger_agent()
    # batch_size 16: a lane's transaction takes 64 commands, and holds 192 at most.
    settings = settings_for(nats_url, sqlite_url, partitions=PARTITIONS, batch_size=16)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    subject = f"cmd.default.test.{agent.name}.credit"
    envs = [
        Envelope.new(f"{agent.name}.credit", {"account": f"a{i % RESOURCES}", "amount": 1},
                     source="test", resource_id=f"a{i % RESOURCES}")
        for i in range(COMMANDS)
    ]  # fmt: skip
    # The backlog is stored before the worker starts: every partition has a full fetch waiting.
    await Publisher(conn.js, settings).publish_many(
        [Outbound.of(partitioned(subject, e, settings), e) for e in envs]
    )
    metrics = Metrics()
    peak = 0

    def held() -> int:
        samples = metrics.registry.collect()
        return int(sum(
            s.value for family in samples if family.name == "meshforge_in_flight"
            for s in family.samples if s.labels.get("consumer", "").startswith(f"{agent.name}_consumer")
        ))  # fmt: skip

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, held())
            await asyncio.sleep(0.002)  # a sample of the gauge, not a synchronisation

    async def applied() -> bool:
        return len(await events_of(conn, agent.name)) >= COMMANDS

    try:
        async with running([agent], settings, store=store, metrics=metrics) as worker:
            room = sum(engine.max_held for engine in worker._engines)
            watcher = asyncio.create_task(watch())
            try:
                await wait_until(applied, within=60, what="every command applied")
            finally:
                watcher.cancel()
        assert peak > 0
        assert peak <= room, f"{peak} commands held at once; the lanes have room for {room}"
    finally:
        store.close()
        await conn.close()
