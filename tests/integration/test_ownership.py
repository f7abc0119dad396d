"""The one object that owns a worker's partition durables (``Ownership`` and its
``Tenure`` per slot), on a real nats-server: the claim (unpin, then what the previous
owner left: into the holds, or waited for and taken back), pin checks, refusal, fencing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from consumer_support import provision_all, settings, unique_agent
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from meshforge.config import Settings
from meshforge.consume.pull import FENCED, PullSource
from meshforge.envelope import Envelope
from meshforge.topology.ownership import Ownership, Tenure
from meshforge.topology.partitions import ensure_bucket
from meshforge.topology.specs import OWNER_GROUP, ConsumerSpec, partition_consumers
from meshforge.topology.subjects import STREAM_COMMANDS
from polling import wait_until


@dataclass
class Slots:
    """What the worker side of an Ownership sees: tenures started, slots stopped, reads."""

    found: int | None = 0  # what read_held answers
    tenures: dict[str, Tenure] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)

    def run(self, tenure: Tenure) -> None:
        self.tenures[tenure.slot] = tenure

    async def stop(self, slot: str) -> None:
        self.stopped.append(slot)

    async def read_held(self, spec: ConsumerSpec) -> int | None:
        self.reads.append(spec.durable)
        return self.found


@asynccontextmanager
async def owned(
    js: JetStreamContext, s: Settings, slots: Slots
) -> AsyncIterator[tuple[Ownership, dict[str, ConsumerSpec]]]:
    specs = partition_consumers(unique_agent(), s)
    await provision_all(js, s, *specs.values())
    kv = await ensure_bucket(js, s)
    ownership = Ownership(js, kv, specs, run=slots.run, stop=slots.stop, period=s.partition_lease / 3,
                          read_held=slots.read_held)  # fmt: skip
    try:
        yield ownership, specs
    finally:
        await ownership.close()


async def held_by_previous_owner(
    nc: NATS, js: JetStreamContext, spec: ConsumerSpec, count: int
) -> PullSource:
    """A previous owner, pinned, holding ``count`` commands unacknowledged."""
    agent = spec.durable.split("_consumer")[0]
    for seq in range(count):
        env = Envelope.new(f"{agent}.step", {"seq": seq}, resource_id="r", source="test")
        await js.publish(f"cmd.default.test.{agent}.step.0", env.encode(), headers=env.headers())
    previous = PullSource(nc, STREAM_COMMANDS, spec.durable, group=OWNER_GROUP)
    await previous.start()
    got = await previous.fetch(count)
    assert len(got.messages) == count and previous.pin is not None, got
    return previous


async def test_a_claim_fences_the_previous_owner_and_reads_what_it_left_without_waiting(
    nc: NATS, js: JetStreamContext
) -> None:
    s = settings(partitions=1, ack_wait=3.0, backoff=())
    slots = Slots(found=2)
    async with owned(js, s, slots) as (ownership, specs):
        previous = await held_by_previous_owner(nc, js, specs["p0"], 2)
        try:
            tenure = ownership.take("p0", clean=False)
            assert slots.tenures["p0"] is tenure and ownership.tenures["p0"] is tenure
            loop = asyncio.get_running_loop()
            started = loop.time()
            await tenure.claim()
            # The holds have it: no wait for the previous owner's commands to come due.
            assert loop.time() - started < 2.0
            assert slots.reads == [specs["p0"].durable] and tenure.take_back() == 0
            refused = await previous.fetch(1)
            assert (refused.outcome, refused.status) == ("error", FENCED)
        finally:
            await previous.close()


async def test_a_worker_that_cannot_read_waits_for_redeliveries_and_takes_them_back_once(
    nc: NATS, js: JetStreamContext
) -> None:
    s = settings(partitions=1, ack_wait=1.0, backoff=())
    slots = Slots(found=None)  # e.g. bound to a tenant: no reading the stream by sequence
    async with owned(js, s, slots) as (ownership, specs):
        previous = await held_by_previous_owner(nc, js, specs["p0"], 2)
        try:
            clean = ownership.take("p0", clean=True)
            await clean.claim()  # handed back: nothing to wait for
            assert clean.take_back() == 0
            taken = ownership.take("p0", clean=False)
            loop = asyncio.get_running_loop()
            started = loop.time()
            await taken.claim()
            assert loop.time() - started >= 1.0  # the ack wait: they are due again now
            assert taken.take_back() == 2
            assert taken.take_back() == 0  # given out once
        finally:
            await previous.close()


async def test_refused_fences_the_consumer_and_gives_the_lease_up_unless_taken_again(
    js: JetStreamContext,
) -> None:
    s = settings(partitions=1)
    slots = Slots()
    async with owned(js, s, slots) as (ownership, _):
        await ownership.leases.step()
        assert ownership.owns("p0") and ownership.owns("u")
        old = slots.tenures["p0"]
        fences: list[str] = []
        old.attach(lambda: fences.append("old"))
        # The slot was started again meanwhile: the past tenure's refusal costs no lease.
        new = ownership.take("p0", clean=True)
        new.attach(lambda: fences.append("new"))
        await old.refused()
        assert old.fenced and fences == ["old"] and ownership.owns("p0")
        await new.refused()
        assert fences == ["old", "new"] and not ownership.owns("p0")
        await wait_until(lambda: "p0" in slots.stopped, timeout=5, what="the refused slot stopped")
        late: list[str] = []
        new.attach(lambda: late.append("late"))  # a consumer made after the fence stops at once
        assert late == ["late"]


async def test_a_failed_renewal_fences_the_slot_at_once(js: JetStreamContext) -> None:
    s = settings(partitions=1)
    slots = Slots()
    async with owned(js, s, slots) as (ownership, _):
        await ownership.leases.step()
        tenure = slots.tenures["p0"]
        fences: list[str] = []
        tenure.attach(lambda: fences.append("p0"))
        # Another worker has the key now (our lease ran out while we were away).
        await ownership.leases.kv.put(f"lease.{ownership.leases.group}.p0", b"another-worker")
        await ownership.leases.step()
        assert tenure.fenced and fences == ["p0"] and not ownership.owns("p0")
        await wait_until(lambda: "p0" in slots.stopped, timeout=5, what="the lost slot stopped")


async def test_an_idle_owner_takes_the_slot_again_from_a_client_pinned_after_its_claim(
    nc: NATS, js: JetStreamContext
) -> None:
    s = settings(partitions=1, ack_wait=3.0, backoff=())
    slots = Slots(found=1)
    async with owned(js, s, slots) as (ownership, specs):
        tenure = ownership.take("p0", clean=True)
        await tenure.claim()
        rogue = await held_by_previous_owner(nc, js, specs["p0"], 1)  # pinned after the claim
        try:
            await tenure.unpinned_idle(lambda: True)  # we are pinned ourselves: nothing to do
            assert len(slots.reads) == 1
            await tenure.unpinned_idle(lambda: False)
            # Unpinned again, and what the rogue holds is read into the holds.
            assert len(slots.reads) == 2 and tenure.take_back() == 0
            refused = await rogue.fetch(1)
            assert (refused.outcome, refused.status) == ("error", FENCED)
            tenure.fence()
            await tenure.unpinned_idle(lambda: False)  # fenced: it owns nothing to take again
            assert len(slots.reads) == 2
        finally:
            await rogue.close()


async def test_a_tenure_of_its_own_claims_nothing_and_a_refusal_fences_it() -> None:
    s = settings(partitions=1)
    spec = partition_consumers(unique_agent(), s)["p0"]
    alone = Tenure(spec)
    fences: list[str] = []
    alone.attach(lambda: fences.append("x"))
    await alone.claim()
    await alone.unpinned_idle(lambda: False)
    assert alone.group == OWNER_GROUP and alone.take_back() == 0 and fences == []
    await alone.refused()
    assert alone.fenced and fences == ["x"]
