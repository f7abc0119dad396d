"""The server's fence of partition durables: a priority group whose one pinned client is
the partition's owner (pinned_client, nats-server >= 2.11), unpinned by every new owner."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from consumer_support import connection, provision_all, running, settings, unique_agent
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from partition_agents import SequenceAgent

from meshforge.cli.demo_support import read_stream
from meshforge.config import Settings
from meshforge.consume.consumer import Consumer
from meshforge.consume.decisions import Decision, Delivery
from meshforge.consume.pull import FENCED, PullSource
from meshforge.envelope import Envelope, decode
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.runtime.engine import Engine
from meshforge.runtime.worker import _Partitions
from meshforge.store import Store, open_store
from meshforge.topology.ownership import Ownership, Tenure
from meshforge.topology.partitions import ensure_bucket, pinned_client, unpin
from meshforge.topology.provision import ensure
from meshforge.topology.specs import OWNER_GROUP, ConsumerSpec, agent_consumer, partition_consumers
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_EVENTS
from meshforge.transport.connection import Connection
from polling import wait_until


async def raw_config(nc: NATS, durable: str) -> dict[str, Any]:
    reply = await nc.request(f"$JS.API.CONSUMER.INFO.{STREAM_COMMANDS}.{durable}", b"", timeout=5)
    config: dict[str, Any] = json.loads(reply.data)["config"]
    return config


async def owner(
    conn: Connection, specs: dict[str, ConsumerSpec], s: Settings, tmp_path: Path
) -> tuple[Store, Engine[Any], _Partitions, Ownership]:
    """A worker's partitions of the SequenceAgent over one engine, on a store of its own,
    and its ownership of them (no lease rounds: the test takes slots itself)."""
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}")
    publisher = Publisher(conn.js, s)
    engine = Engine(SequenceAgent(), store, publisher, settings=s, metrics=Metrics())
    part = _Partitions(conn, specs, [engine], publisher, s, Metrics())
    kv = await ensure_bucket(conn.js, s)
    ownership = Ownership(conn.js, kv, specs, run=part.start, stop=part.stop, period=s.partition_lease / 3,
                          read_held=part.read_held, last_error=lambda: conn.last_error)  # fmt: skip
    return store, engine, part, ownership


async def release(part: _Partitions, engine: Engine[Any], store: Store) -> None:
    await part.stop("p0")
    await asyncio.to_thread(engine.close)
    await asyncio.to_thread(store.close)


async def publish(js: JetStreamContext, subject: str, seq: int) -> None:
    env = Envelope.new(
        "seq.step", {"seq": seq}, resource_id="r", source="test", tenant_id=subject.split(".")[1]
    )
    await js.publish(subject, env.encode(), headers=env.headers())


async def test_provisioning_gives_partition_durables_the_owner_group_and_adds_it_to_older_ones(
    nc: NATS, js: JetStreamContext
) -> None:
    s = settings(partitions=2, partition_lease=4.0)
    agent = unique_agent()
    specs = partition_consumers(agent, s)
    await provision_all(js, s)
    # p0 as a MeshForge without the fence made it: no priority group.
    await js.add_consumer(
        STREAM_COMMANDS, replace(specs["p0"], priority_group="", pinned_ttl=0).config()
    )
    assert "priority_groups" not in await raw_config(nc, specs["p0"].durable)

    first = await ensure(js, [], list(specs.values()))
    actions = {step.spec.durable: (str(step.action), step.details) for step in first.steps}
    assert actions[specs["p0"].durable] == (
        "update",
        "priority_group none -> owner pinned_client 1m",
    )
    assert actions[specs["p1"].durable][0] == "create"
    for spec in specs.values():
        config = await raw_config(nc, spec.durable)
        assert config["priority_groups"] == [OWNER_GROUP]
        assert config["priority_policy"] == "pinned_client"
        assert config["priority_timeout"] == 60 * 10**9  # max(60 s, 10 leases)
        assert config["filter_subject"] == spec.filter_subject

    second = await ensure(js, [], list(specs.values()))
    assert not second.changed, [str(step) for step in second.steps]
    # The unpartitioned agent durable stays as it was: no group.
    plain = agent_consumer(agent + "x", s)
    await ensure(js, [], [plain])
    assert "priority_groups" not in await raw_config(nc, plain.durable)


async def test_a_pull_with_a_revoked_pin_is_refused_and_the_consumer_stops(
    nats_url: str, js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    s = settings(partitions=1)
    agent = unique_agent()
    spec = partition_consumers(agent, s)["p0"]
    await provision_all(js, s, spec)
    subject = f"cmd.default.test.{agent}.step.0"
    handled: list[int] = []

    async def handle(delivery: Delivery) -> Decision | None:
        handled.append(delivery.envelope.payload["seq"])
        return None

    caplog.set_level(logging.INFO, "meshforge")
    async with connection(nats_url) as conn:
        consumer = Consumer(conn, spec, handler=handle, settings=s, provision=False)
        async with running(consumer) as task:
            await publish(js, subject, 0)
            await wait_until(
                lambda: handled == [0] and consumer.pinned, timeout=10, what="first command, pinned"
            )
            pin = await pinned_client(conn.js, spec.stream, spec.durable, OWNER_GROUP)
            assert pin is not None

            # Another worker claims the partition: its unpin revokes our pin.
            await unpin(js, spec.stream, spec.durable, OWNER_GROUP)
            await publish(js, subject, 1)
            successor = PullSource(conn.nc, spec.stream, spec.durable, group=OWNER_GROUP)
            await successor.start()
            try:
                got = await successor.fetch(1)
                assert [m.headers.get("Nats-Pin-Id") != pin for m in got.messages] == [True], got
                assert successor.pin is not None and successor.pin != pin
                for msg in got.messages:
                    await msg.ack()
                await asyncio.wait_for(task, 10)  # the consumer stopped by itself
                assert consumer.owner is not None and consumer.owner.fenced
                assert consumer.fenced and handled == [0]
                # The old pin is refused for good, even with nothing left to deliver.
                stale = PullSource(conn.nc, spec.stream, spec.durable, group=OWNER_GROUP)
                await stale.start()
                stale.pin = pin
                refused = await stale.fetch(1)
                await stale.close()
                assert (refused.outcome, refused.status) == ("error", FENCED)
            finally:
                await successor.close()
    lines = [
        r.getMessage() for r in caplog.records if "another worker owns it now" in r.getMessage()
    ]
    assert len(lines) == 1 and spec.durable in lines[0], lines


async def test_claiming_a_partition_unpins_the_previous_owner_before_the_first_pull(
    nats_url: str, js: JetStreamContext, tmp_path: Path
) -> None:
    s = settings(partitions=1)
    tenant = unique_agent()  # durables of their own for the SequenceAgent ("seq")
    specs = partition_consumers("seq", s, tenant=tenant, namespace="t")
    await provision_all(js, s, *specs.values())
    subject = f"cmd.{tenant}.t.seq.step.0"
    async with connection(nats_url) as conn:
        # The previous owner: pinned, then it stalls with a pull on its way.
        previous = PullSource(conn.nc, STREAM_COMMANDS, specs["p0"].durable, group=OWNER_GROUP)
        await previous.start()
        await publish(js, subject, 0)
        got = await previous.fetch(1)
        assert got.messages and previous.pin is not None
        for msg in got.messages:
            await msg.ack()

        store, engine, part, ownership = await owner(conn, specs, s, tmp_path)
        try:
            ownership.take(
                "p0", clean=True
            )  # handed back cleanly: no redelivery wait, only the unpin
            consumer = part.consumers["p0"]
            await wait_until(
                lambda: consumer.ready.is_set(), timeout=10, what="the new owner pulling"
            )
            # The previous owner pulls again with its pin, as the next command is stored:
            # the new owner gets the command, and the previous one nothing (told so now,
            # or when its pull expires).
            pulling = asyncio.create_task(previous.fetch(1))
            await publish(js, subject, 1)
            await wait_until(lambda: consumer.pinned, timeout=10, what="the new owner pinned")
            missed = await asyncio.wait_for(pulling, 10)
            assert missed.messages == [] and missed.outcome in ("error", "empty"), missed
            refused = await previous.fetch(1)
            assert (refused.outcome, refused.status) == ("error", FENCED)
            info = await js.consumer_info(STREAM_COMMANDS, specs["p0"].durable)
            await wait_until(lambda: ack_floor(js, specs["p0"].durable, info.delivered.stream_seq), timeout=10,
                             what="the command applied by the new owner")  # fmt: skip
            assert not part.failed.done()
        finally:
            await previous.close()
            await release(part, engine, store)


async def ack_floor(js: JetStreamContext, durable: str, seq: int) -> bool:
    info = await js.consumer_info(STREAM_COMMANDS, durable)
    return bool(info.ack_floor and info.ack_floor.stream_seq >= seq and not info.num_ack_pending)


async def test_a_partition_durable_without_the_group_is_a_clear_error_at_claim(
    nats_url: str, js: JetStreamContext, tmp_path: Path
) -> None:
    """A worker that does not provision, on a durable an older MeshForge made: it must not
    pull unfenced; it stops, naming the fix."""
    s = settings(partitions=1)
    tenant = unique_agent()
    specs = partition_consumers("seq", s, tenant=tenant, namespace="t")
    await provision_all(
        js, s, *(replace(spec, priority_group="", pinned_ttl=0) for spec in specs.values())
    )
    async with connection(nats_url) as conn:
        store, engine, part, ownership = await owner(conn, specs, s, tmp_path)
        try:
            ownership.take("p0", clean=True)
            await wait_until(part.failed.done, timeout=10, what="the claim failing")
            error = part.failed.exception()
            assert error is not None and "meshforge provision --partitions N" in str(error), error
            assert not part.consumers["p0"].ready.is_set()  # never pulled
        finally:
            await release(part, engine, store)


async def test_an_idle_owner_unpins_a_client_that_got_the_pin_after_its_claim(
    nats_url: str, js: JetStreamContext, tmp_path: Path
) -> None:
    """A worker that stalled right after claiming, before anything was delivered to it,
    pulls without a pin and can be pinned after the new owner's unpin: the new owner,
    idle and unpinned, finds it and fences it off again."""
    s = settings(partitions=1, ack_wait=1.0, backoff=())
    tenant = unique_agent()
    specs = partition_consumers("seq", s, tenant=tenant, namespace="t")
    await provision_all(js, s, *specs.values())
    subject = f"cmd.{tenant}.t.seq.step.0"
    async with connection(nats_url) as conn:
        rogue = PullSource(conn.nc, STREAM_COMMANDS, specs["p0"].durable, group=OWNER_GROUP)
        await rogue.start()
        early = asyncio.create_task(rogue.fetch(1))  # first in the server's queue, no pin
        store, engine, part, ownership = await owner(conn, specs, s, tmp_path)
        try:
            ownership.take("p0", clean=True)
            consumer = part.consumers["p0"]
            await wait_until(lambda: consumer.ready.is_set(), timeout=10, what="the owner pulling")
            await publish(js, subject, 0)
            got = await asyncio.wait_for(early, 10)
            assert len(got.messages) == 1 and rogue.pin is not None  # the rogue was pinned
            # Pinned, the rogue is served (the command again, when its ack wait runs out)
            # until the owner's idle pull ends and it sees a pin that is not its own.
            deadline = asyncio.get_running_loop().time() + 20
            refused = await asyncio.wait_for(rogue.fetch(1), 20)
            while (
                refused.outcome in ("messages", "empty")
                and asyncio.get_running_loop().time() < deadline
            ):
                refused = await asyncio.wait_for(rogue.fetch(1), 20)
            assert (refused.outcome, refused.status) == ("error", FENCED)
            # What the rogue held comes back to the owner, which applies it.
            await wait_until(lambda: consumer.pinned, timeout=20, what="the owner pinned")
            await wait_until(
                lambda: all_acked(js, specs["p0"].durable), timeout=20, what="everything applied"
            )
            assert not part.failed.done()
        finally:
            await rogue.close()
            await release(part, engine, store)


async def all_acked(js: JetStreamContext, durable: str) -> bool:
    info = await js.consumer_info(STREAM_COMMANDS, durable)
    return not info.num_ack_pending and not info.num_pending


@pytest.mark.parametrize("reads", [True, False], ids=["holds", "take-back"])
async def test_a_client_pinned_after_the_claim_that_beats_in_progress_on_its_first_command_keeps_the_order(
    nats_url: str,
    js: JetStreamContext,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    reads: bool,
) -> None:
    """A client pinned after the owner's claim holds two commands of one resource and sends
    ``in_progress`` for the first, so the second comes due first. The idle owner finds it
    pinned and takes the partition again: what it holds is read into the owner's holds
    (``holds``: the beats go on past the ack wait), or, for a worker that cannot read the
    stream (``take-back``: the beat ends before the wait does), waited for and taken back
    by the running pull loop as one batch in stream order. Either way: 0, then 1."""
    s = settings(partitions=1, ack_wait=2.0, backoff=(), batch_size=1)
    tenant = unique_agent()
    specs = partition_consumers("seq", s, tenant=tenant, namespace="t")
    await provision_all(js, s, *specs.values())
    caplog.set_level(logging.INFO, "meshforge")
    async with connection(nats_url) as conn:
        store, engine, _, ownership = await owner(conn, specs, s, tmp_path)
        if not reads:

            async def cannot_read(spec: ConsumerSpec) -> int | None:
                return None

            ownership.read_held = cannot_read
        tenure = Tenure(specs["p0"], ownership, slot="p0")
        await tenure.claim()  # nothing left behind: unpinned, and nothing held
        for seq in range(2):
            await publish(js, f"cmd.{tenant}.t.seq.step.0", seq)
        rogue = PullSource(conn.nc, STREAM_COMMANDS, specs["p0"].durable, group=OWNER_GROUP)
        await rogue.start()
        got = await rogue.fetch(2)
        assert len(got.messages) == 2 and rogue.pin is not None, got
        first = min(got.messages, key=lambda m: m.metadata.sequence.stream)

        async def beat(times: int) -> None:
            for _ in range(times):
                await asyncio.sleep(1.0)  # pacing: a keep-alive beat a second, as a slow handler's
                await first.in_progress()

        await beat(1)
        beating = asyncio.create_task(beat(3 if reads else 0))
        consumer = Consumer(
            conn, specs["p0"], batch_handler=engine.handle, settings=s, metrics=Metrics(),
            publisher=Publisher(conn.js, s), provision=False, batch_size=1, max_held=engine.max_held,
            max_deliver=None, owner=tenure,
        )  # fmt: skip
        try:
            async with running(consumer):
                await wait_until(
                    lambda: applied(js, tenant, 2), timeout=30, what="both commands applied"
                )
            events = await stepped_events(js, tenant)
            assert [(e.payload["seq"], e.payload["after"]) for e in events] == [(0, -1), (1, 0)]
            lines = [r.getMessage() for r in caplog.records]
            assert any(
                "another client is pinned while this worker owns it" in line for line in lines
            )
            took = [line for line in lines if "took back" in line]
            assert took == (
                []
                if reads
                else [
                    f"consumer {specs['p0'].durable}: took back 2 of 2 held by the previous owner"
                ]
            )
        finally:
            beating.cancel()
            await rogue.close()
            await asyncio.to_thread(engine.close)
            await asyncio.to_thread(store.close)


async def stepped_events(js: JetStreamContext, tenant: str) -> list[Envelope]:
    msgs = await read_stream(js, STREAM_EVENTS, f"evt.{tenant}.t.seq.stepped")
    return [decode(m.data, m.headers) for m in msgs]


async def applied(js: JetStreamContext, tenant: str, count: int) -> bool:
    return len(await stepped_events(js, tenant)) >= count
