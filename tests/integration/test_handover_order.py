"""Per-resource order through partition hand-overs, one test per way a partition changes
hands with commands of its resources still outstanding at the old owner: a slow handler's
``in_progress`` after the new owner counted, more held than the new owner may hold, a
clean hand-back with work in flight, SIGKILL and SIGSTOP of the owner.

Each runs real worker processes of ``partition_agents:SequenceAgent`` on one PostgreSQL
store and checks, per resource, that every command was applied once (events counted in the
stream, not compared as sets), in the order it was stored, and that the stored state agrees.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from nats.js.kv import KeyValue
from partition_agents import Seen
from test_partitions import (
    check_order,
    ensure_bucket_exists,
    owners,
    start_worker,
    stepped,
    stop_worker,
)

from meshforge.config import Settings, load_settings
from meshforge.envelope import Envelope, Outbound
from meshforge.publish.publisher import Publisher
from meshforge.store import open_store
from meshforge.topology.partitions import BUCKET, partition_of, partitioned
from meshforge.topology.provision import ensure
from meshforge.topology.scope import Scope
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.connection import Connection, connect
from meshforge.transport.server import EmbeddedServer
from polling import wait_until

PARTITIONS = 4
SLOTS = {*(f"p{k}" for k in range(PARTITIONS)), "u"}
# Ack wait and redelivery delay of 3 s: a handler of 1.1 s is slower than a third of it
# (in_progress beats) and faster than the handler timeout (half of it).
TIMING = {
    "MESHFORGE_ACK_WAIT": "3s",
    "MESHFORGE_BACKOFF": "3s",
    "MESHFORGE_PARTITION_LEASE": "1.5s",
}
SLOW = 1.1


@dataclass
class Rig:
    """Worker processes of the ``seq`` agent on a private server and a PostgreSQL store."""

    server: EmbeddedServer
    store: str
    tmp: Path
    conn: Connection
    settings: Settings
    kv: KeyValue | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: dict[int, Path] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)  # resource -> commands published

    def start(self, **env: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"w{len(self.procs)}.log"
        proc = start_worker(self.server.url, self.store, log, **{**TIMING, **env})
        self.procs.append(proc)
        self.logs[proc.pid] = log
        return proc

    async def bucket(self) -> KeyValue:
        if self.kv is None:
            await wait_until(
                lambda: ensure_bucket_exists(self.conn.js), timeout=30, what="the ownership bucket"
            )
            self.kv = await self.conn.js.key_value(BUCKET)
        return self.kv

    async def slots_of(self, proc: subprocess.Popen[bytes]) -> set[str]:
        found = await owners(await self.bucket())
        return {slot for slot, owner in found.items() if f"-{proc.pid}-" in owner}

    async def owning(self, shares: dict[int, int], what: str) -> None:
        """Until each worker (by pid) owns that many slots, and all of them are owned."""

        async def check() -> bool:
            found = await owners(await self.bucket())
            if set(found) != SLOTS:
                return False
            counts = {pid: sum(f"-{pid}-" in o for o in found.values()) for pid in shares}
            return counts == shares

        await wait_until(check, timeout=30, what=what)

    async def send(self, resources: list[str], seqs: range, **payload: Any) -> None:
        out = []
        for seq in seqs:
            for r in resources:
                env = Envelope.new(
                    "seq.step", {"seq": seq, **payload}, resource_id=r, source="test"
                )
                out.append(
                    Outbound.of(partitioned("cmd.default.test.seq.step", env, self.settings), env)
                )
                self.sent[r] = max(self.sent.get(r, 0), seq + 1)
        await Publisher(self.conn.js, self.settings).publish_many(out)

    async def ack_pending(self, slot: str) -> int:
        info = await self.conn.js.consumer_info(STREAM_COMMANDS, f"seq_consumer_{slot}")
        return int(info.num_ack_pending)

    @contextlib.asynccontextmanager
    async def naks(self, slot: str) -> AsyncIterator[asyncio.Event]:
        """Set when the server has taken a nak on ``slot``'s durable (its advisory)."""
        naked = asyncio.Event()

        async def seen(_: Any) -> None:
            naked.set()

        subject = f"$JS.EVENT.ADVISORY.CONSUMER.MSG_NAKED.{STREAM_COMMANDS}.seq_consumer_{slot}"
        sub = await self.conn.nc.subscribe(subject, cb=seen)
        try:
            yield naked
        finally:
            await sub.unsubscribe()

    def found(self, proc: subprocess.Popen[bytes], pattern: str) -> re.Match[str] | None:
        return re.search(pattern, self.logs[proc.pid].read_text(errors="replace"))

    def logged(self, proc: subprocess.Popen[bytes], pattern: str) -> bool:
        return self.found(proc, pattern) is not None

    async def verify(self) -> None:
        """Every command applied once, in stored order, per resource; the store agrees."""
        total = sum(self.sent.values())

        async def applied() -> bool:
            return len(await stepped(self.conn)) >= total

        await wait_until(applied, timeout=60, what=f"{total} commands applied")
        events = await stepped(self.conn)
        check_order(events, 0, 0, dict(self.sent))
        assert len(events) == total, f"{len(events) - total} event(s) stored twice"
        assert len({e.id for e in events}) == total
        store = await asyncio.to_thread(open_store, self.store)
        try:
            with store.transaction() as tx:
                for r, count in self.sent.items():
                    raw = tx.state_get("seq", r, scope=Scope("default", "test"))
                    assert raw is not None, f"{r}: no state stored"
                    state = msgspec.json.decode(raw, type=Seen)
                    assert (state.last, state.count) == (count - 1, count), (
                        f"{r}: stored state {state}"
                    )
        finally:
            store.close()


@contextlib.asynccontextmanager
async def rig(server: EmbeddedServer, store: str, tmp: Path) -> AsyncIterator[Rig]:
    settings = load_settings({"nats_url": server.url, "partitions": PARTITIONS}, env={})
    conn = await connect(settings, name="handover-test")
    await ensure(conn.js, default_streams(settings))
    made = Rig(server, store, tmp, conn, settings)
    try:
        yield made
    finally:
        for proc in made.procs:
            stop_worker(proc)
        await conn.close()


def resources_in(slot: str, count: int) -> list[str]:
    """``count`` resource names whose commands go to partition ``slot``."""
    names = (f"r{i}" for i in itertools.count())
    return list(
        itertools.islice((n for n in names if f"p{partition_of(n, PARTITIONS)}" == slot), count)
    )


async def two_workers(
    r: Rig, **second: str
) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """A first worker owning everything, then a second one given its share (3 and 2)."""
    first = r.start()
    await r.owning({first.pid: 5}, "the first worker owning every slot")
    other = r.start(**second)
    await r.owning({first.pid: 3, other.pid: 2}, "both workers owning their share")
    return first, other


def a_partition_of(slots: set[str]) -> str:
    return sorted(s for s in slots if s != "u")[0]


# ---------------------------------------------------------------------- the cases


async def test_in_progress_after_the_new_owner_counted(
    private_server: EmbeddedServer, own_pg: str, tmp_path: Path
) -> None:
    """The old owner stalls past its lease holding as much as it may (12: no pull of its
    own is open, so nothing tells it at once that it lost the partition); the new owner
    reads what it holds into its holds and pulls at once; the old owner runs again and its
    slow handlers' ``in_progress`` beats push those commands later still. Later commands
    of their resources must wait for them."""
    # An ack wait well over the lease: the stop ends (1 s after the count) before what it
    # holds comes due, with every keep-alive beat overdue.
    timing = {"MESHFORGE_ACK_WAIT": "9s", "MESHFORGE_BACKOFF": "9s"}
    async with rig(private_server, own_pg, tmp_path) as r:
        old = r.start(MESHFORGE_BATCH_SIZE="1", **timing)
        await r.owning({old.pid: 5}, "the first worker owning every slot")
        new = r.start(**timing)
        await r.owning({old.pid: 3, new.pid: 2}, "both workers owning their share")
        slot = a_partition_of(await r.slots_of(old))
        names = resources_in(slot, 2)
        # Over a third of the ack wait, under half: the owner fetches the other 10 meanwhile
        # (a machine at load 9 did not within 2.8 s of a 6 s ack wait).
        await r.send(names, range(1), pause=4.2)
        await r.send(names, range(1, 6), pause=0.4)
        await wait_until(
            lambda: at(r.ack_pending(slot), 12), timeout=20, what="12 commands held by the owner"
        )
        os.kill(old.pid, signal.SIGSTOP)
        try:
            counted = rf"seq_consumer_{slot}: \d+ unacknowledged"
            await wait_until(
                lambda: r.logged(new, counted), timeout=30, what=f"the new owner counting {slot}"
            )
            # The fault's length, not a wait for an event: its beats go out after the take-over.
            await asyncio.sleep(1.0)
        finally:
            os.kill(old.pid, signal.SIGCONT)  # its keep-alive beats go out now
        await r.send(names, range(6, 10))
        await r.verify()
        # The case happened: the new owner took over while the old one held all 12.
        assert r.logged(new, rf"seq_consumer_{slot}: 12 unacknowledged by the previous owner")


async def test_more_held_than_the_new_owner_may_hold(
    private_server: EmbeddedServer, own_pg: str, tmp_path: Path
) -> None:
    """The owner dies holding 21 commands of three resources (20 if a head finished in
    time), fetched in 7 waves whose ack waits run out in an order of their own; the new owner's consumer may hold 12
    (``MESHFORGE_BATCH_SIZE=1``: 3 x 4 x 1), its holds keep all 21. Each resource's order
    must hold."""
    async with rig(private_server, own_pg, tmp_path) as r:
        old, new = await two_workers(r, MESHFORGE_BATCH_SIZE="1")
        slot = a_partition_of(await r.slots_of(old))
        names = resources_in(slot, 3)
        await r.send(names, range(1), pause=SLOW)
        for wave in range(1, 7):
            await asyncio.sleep(0.15)  # pacing: each wave its own fetch, its own beats
            await r.send(names, range(wave, wave + 1))
        await wait_until(
            lambda: at(r.ack_pending(slot), 21), timeout=20, what="21 commands held by the owner"
        )
        await asyncio.sleep(0.5)  # pacing: the waves' in_progress beats spread over the ack wait
        old.kill()
        old.wait()
        # What it left (a head that finished in time was acknowledged): still more than 12.
        left = await r.ack_pending(slot)
        assert left > 12
        await r.owning({new.pid: 5}, "the new owner owning every slot")
        await r.send(names, range(7, 10))
        await r.verify()
        assert r.logged(new, rf"seq_consumer_{slot}: {left} unacknowledged by the previous owner")


async def test_clean_hand_back_with_work_in_flight(
    private_server: EmbeddedServer, own_pg: str, tmp_path: Path
) -> None:
    """A second worker joins and the first hands two partitions back while its slow
    handlers are still running (longer than its shutdown timeout: it naks them, after the
    last pull's leftovers), and commands keep coming."""
    async with rig(private_server, own_pg, tmp_path) as r:
        old = r.start(MESHFORGE_SHUTDOWN_TIMEOUT="1s")
        await r.owning({old.pid: 5}, "the first worker owning every slot")
        names = [n for k in range(PARTITIONS) for n in resources_in(f"p{k}", 2)]
        await r.send(names, range(3), pause=SLOW / 2)
        feeding = asyncio.create_task(feed(r, names, 3))
        try:
            new = r.start(MESHFORGE_BATCH_SIZE="1")
            await r.owning({old.pid: 3, new.pid: 2}, "two partitions handed back")
            await wait_until(lambda: r.logged(old, r"handing back"), timeout=10, what="a hand-back")
        finally:
            feeding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeding
        await r.verify()
        assert r.logged(old, r"nak'ed \d+ unfinished"), "the hand-back finished its work in time"


async def test_sigkill_of_the_owner_mid_flight(
    private_server: EmbeddedServer, own_pg: str, tmp_path: Path
) -> None:
    """The owner is killed while slow commands are in flight and one resource's head
    waits on ``Retry(delay=8)`` (longer than any ack wait): what it left holds back its
    resources' later commands at the new owner."""
    async with rig(private_server, own_pg, tmp_path) as r:
        old, new = await two_workers(r)
        slot = a_partition_of(await r.slots_of(old))
        head, slow = resources_in(slot, 2)
        async with r.naks(slot) as naked:
            await r.send([head], range(1), retry_once=str(tmp_path / "retried"), retry=8)
            await wait_until(naked.is_set, timeout=20, what="the head nak'ed for 8 s")
        await r.send([slow], range(3), pause=SLOW)
        await wait_until(
            lambda: at(r.ack_pending(slot), 4), timeout=20, what="the slow group in flight"
        )
        old.kill()
        old.wait()
        await r.owning({new.pid: 5}, "the new owner owning every slot")
        await r.send([head], range(1, 6))
        await r.send([slow], range(3, 8))
        await r.verify()


async def test_sigstop_of_the_owner_past_its_lease(
    private_server: EmbeddedServer, own_pg: str, tmp_path: Path
) -> None:
    """The owner stops (SIGSTOP) past its lease with slow work in flight and a head
    waiting on ``Retry``; the other worker takes over and gets later commands; the old
    owner runs again (SIGCONT) and finishes what it had."""
    async with rig(private_server, own_pg, tmp_path) as r:
        old, new = await two_workers(r)
        slot = a_partition_of(await r.slots_of(old))
        head, slow = resources_in(slot, 2)
        async with r.naks(slot) as naked:
            await r.send([head], range(1), retry_once=str(tmp_path / "retried"), retry=8)
            await wait_until(naked.is_set, timeout=20, what="the head nak'ed for 8 s")
        await r.send([slow], range(3), pause=SLOW)
        await wait_until(
            lambda: at(r.ack_pending(slot), 4), timeout=20, what="the slow group in flight"
        )
        os.kill(old.pid, signal.SIGSTOP)
        try:
            await r.owning({new.pid: 5}, "the other worker owning every slot")
            await r.send([head], range(1, 6))
            await r.send([slow], range(3, 8))
            pulled = rf"consumer MESHFORGE_COMMANDS/seq_consumer_{slot} pulling"
            await wait_until(
                lambda: r.logged(new, pulled), timeout=20, what=f"the new owner pulling {slot}"
            )
        finally:
            os.kill(old.pid, signal.SIGCONT)
        await r.verify()
        assert old.poll() is None and new.poll() is None


async def feed(r: Rig, names: list[str], start: int) -> None:
    """Commands for ``names``, one round at a time, until cancelled."""
    seq = start
    while True:
        await r.send(names, range(seq, seq + 1))
        seq += 1
        await asyncio.sleep(0.1)  # pacing: a steady stream of commands, not a wait


async def at(value: Any, n: int) -> bool:
    return bool(await value >= n)
