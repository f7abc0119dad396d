"""Partitioned agents: N durables by resource, shared out by leases, order kept per resource."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
from nats.js import JetStreamContext
from nats.js.api import StreamConfig, SubjectTransform
from nats.js.kv import KeyValue

from meshforge.cli.demo_support import read_stream
from meshforge.config import Settings, load_settings
from meshforge.envelope import Envelope, Outbound, decode
from meshforge.publish.publisher import Publisher
from meshforge.topology.partitions import BUCKET, Leases, ensure_bucket, partition_of, partitioned
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_EVENTS
from meshforge.transport.connection import Connection, connect
from meshforge.transport.server import EmbeddedServer
from polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
SLOTS = ["p0", "p1", "p2", "p3", "u"]


async def test_partition_matches_the_servers_partition_mapping(js: JetStreamContext) -> None:
    """A publisher may let nats-server partition by a token: it must agree with ours."""
    name = f"PART{uuid.uuid4().hex[:6]}"
    subject = f"{name.lower()}.*"
    mapping = SubjectTransform(
        src=subject, dest=name.lower() + ".{{partition(7,1)}}.{{wildcard(1)}}"
    )
    await js.add_stream(StreamConfig(name=name, subjects=[subject], subject_transform=mapping))
    try:
        keys = [f"order-{i}" for i in range(50)] + ["A-1", "sku_9", "x"]
        for key in keys:
            await js.publish(f"{name.lower()}.{key}", b"")
        for seq, key in enumerate(keys, start=1):
            stored = await js.get_msg(name, seq)
            assert stored.subject == f"{name.lower()}.{partition_of(key, 7)}.{key}"
    finally:
        await js.delete_stream(name)


# ------------------------------------------------------------------ provisioning


def provision(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_")}
    env.update(PYTHONPATH=str(ROOT / "src"), COLUMNS="250", MESHFORGE_PARTITION_LEASE="4s")
    return subprocess.run(
        [sys.executable, "-m", "meshforge", "provision", "--nats-url", url, *args],
        env=env, text=True, capture_output=True, timeout=60, check=False,
    )  # fmt: skip


async def test_provision_creates_partition_durables_and_the_bucket_idempotently(
    private_server: EmbeddedServer,
) -> None:
    first = provision(private_server.url, "--agent", "seq", "--partitions", "4")
    assert first.returncode == 0, first.stderr
    second = provision(private_server.url, "--agent", "seq", "--partitions", "4")
    assert second.returncode == 0, second.stderr
    assert "no changes" in second.stdout and "create" not in second.stdout
    nc = await nats.connect(private_server.url)
    try:
        js = nc.jetstream()
        durables = sorted(c.name for c in await js.consumers_info(STREAM_COMMANDS))
        assert durables == [*(f"seq_consumer_p{k}" for k in range(4)), "seq_consumer_unpartitioned"]
        info = await js.consumer_info(STREAM_COMMANDS, "seq_consumer_p2")
        assert info.config.filter_subject == "cmd.*.*.seq.*.2"
        status = await (await js.key_value(BUCKET)).status()
        assert status.ttl == 4.0
    finally:
        await nc.close()


# ------------------------------------------------------------------ leases in one process


class Slots:
    """What one Leases holder runs: the slots started and not yet stopped."""

    def __init__(self) -> None:
        self.running: dict[str, bool] = {}

    def start(self, slot: str, clean: bool) -> None:
        self.running[slot] = clean

    async def stop(self, slot: str) -> None:
        self.running.pop(slot, None)


@contextlib.asynccontextmanager
async def holders(
    js: JetStreamContext,
    kv: KeyValue,
    group: str,
    count: int,
    name: str = "w",
    spare: tuple[str, ...] = (),
) -> AsyncIterator[list[tuple[Leases, Slots, asyncio.Task[None]]]]:
    made = []
    for i in range(count):
        run = Slots()
        leases = Leases(js, kv, group, SLOTS, spare=spare, start=run.start, stop=run.stop, period=0.2,
                        worker=f"{name}{i}")  # fmt: skip
        made.append((leases, run, asyncio.create_task(leases.run())))
    try:
        yield made
    finally:
        for _, _, task in made:
            task.cancel()


async def test_leases_share_out_slots_and_a_dead_holders_expire_to_the_others(
    js: JetStreamContext,
) -> None:
    settings = load_settings({"partition_lease": 0.6}, env={})
    kv = await ensure_bucket(js, settings)
    group = f"g{uuid.uuid4().hex[:8]}"
    async with holders(js, kv, group, 2) as made:
        (a, a_slots, a_task), (b, b_slots, _) = made

        def split() -> bool:
            owned = set(a.owned) | set(b.owned)
            return (
                owned == set(SLOTS)
                and not set(a.owned) & set(b.owned)
                and {len(a.owned), len(b.owned)} == {2, 3}
            )

        await wait_until(split, timeout=10, what="two holders with 3 and 2 slots")
        assert set(a_slots.running) == set(a.owned) and set(b_slots.running) == set(b.owned)
        # A holder that dies keeps nothing: its leases expire and the other takes them.
        a_task.cancel()
        loop = asyncio.get_running_loop()
        died = loop.time()
        await wait_until(
            lambda: set(b.owned) == set(SLOTS), timeout=10, what="survivor owns every slot"
        )
        # Within the lease and two rounds (1 s), 5x for a loaded machine: the default 6 s
        # lease, had the setting been ignored, would fail it.
        assert loop.time() - died < 5 * (0.6 + 2 * 0.2)
        taken = set(SLOTS) - set(a.owned)
        assert all(b_slots.running[s] is False for s in set(a.owned)), "taken over, not handed back"
        assert all(s in b_slots.running for s in taken)


async def test_a_joining_holder_gets_slots_handed_back(js: JetStreamContext) -> None:
    kv = await ensure_bucket(js, load_settings({"partition_lease": 0.6}, env={}))
    group = f"g{uuid.uuid4().hex[:8]}"
    async with holders(js, kv, group, 1) as made:
        first, _, _ = made[0]
        await wait_until(lambda: len(first.owned) == 5, timeout=10, what="one holder owns all")
        async with holders(js, kv, group, 1, name="late") as joined:
            second, second_slots, _ = joined[0]
            await wait_until(lambda: len(second.owned) == 2 and len(first.owned) == 3, timeout=10,
                             what="the first hands two back")  # fmt: skip
            assert all(second_slots.running.values()), "handed back cleanly: no redelivery wait"
        await first.close()
        assert first.owned == {}


async def test_the_spare_slot_does_not_count_in_the_fair_share(js: JetStreamContext) -> None:
    # Counted with the partitions, the unpartitioned slot made 4 + 1 slots split 3 and 2:
    # one worker with 3 partitions, the other with 1 and the slot that carries nothing.
    kv = await ensure_bucket(js, load_settings({"partition_lease": 0.6}, env={}))
    group = f"g{uuid.uuid4().hex[:8]}"
    async with holders(js, kv, group, 2, spare=("u",)) as made:
        (a, _, _), (b, _, _) = made

        def split() -> bool:
            counted = [len(set(h.owned) - {"u"}) for h in (a, b)]
            return counted == [2, 2] and ("u" in a.owned) != ("u" in b.owned)

        await wait_until(
            split, timeout=10, what="2 partitions each, the spare slot with one of them"
        )
        assert not set(a.owned) & set(b.owned)


# ------------------------------------------------------------------ worker processes


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    """End a worker process, stopped (SIGSTOP) or not: gracefully, else killed after 30 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_worker(url: str, store: str, log: Path, **extra: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_")}
    env.update(
        PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests' / 'integration'}",
        MESHFORGE_PARTITION_LEASE="1.5s", MESHFORGE_ACK_WAIT="2s", MESHFORGE_BACKOFF="1s",
        MESHFORGE_MAX_DELIVER="20", MESHFORGE_BATCH_SIZE="16", MESHFORGE_LOG_LEVEL="INFO",
    )  # fmt: skip
    env.update(extra)
    args = [
        "run",
        "partition_agents:SequenceAgent",
        "--partitions",
        "4",
        "--store",
        store,
        "--nats-url",
        url,
    ]
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "meshforge", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


async def owners(kv: KeyValue) -> dict[str, str]:
    found = {}
    for slot in SLOTS:
        with contextlib.suppress(Exception):
            entry = await kv.get(f"lease.seq_consumer.{slot}")
            found[slot] = (entry.value or b"").decode()
    return found


async def stepped(conn: Connection) -> list[Envelope]:
    msgs = await read_stream(conn.js, STREAM_EVENTS, "evt.default.test.seq.stepped")
    return [decode(m.data, m.headers) for m in msgs]


def commands(resources: int, seqs: range, settings: Settings, pause: float = 0.0) -> list[Outbound]:
    out = []
    for seq in seqs:
        for r in range(resources):
            env = Envelope.new(
                "seq.step", {"seq": seq, "pause": pause}, resource_id=f"r{r}", source="test"
            )
            out.append(Outbound.of(partitioned("cmd.default.test.seq.step", env, settings), env))
    return out


def check_order(
    events: list[Envelope],
    resources: int,
    upto: int,
    extra: dict[str, int],
    *,
    ordered: bool = True,
) -> None:
    """Each resource's commands applied once each, in the order they were stored (``ordered``)."""
    by_resource: dict[str, list[tuple[int, int]]] = defaultdict(list)
    applier: dict[tuple[str, int], Any] = {}  # which worker applied it: said on a failure
    for env in events:
        by_resource[env.resource_id or ""].append((env.payload["seq"], env.payload["after"]))
        applier[(env.resource_id or "", env.payload["seq"])] = env.payload.get("pid")
    expected = {f"r{r}": upto for r in range(resources)} | extra
    assert {r: len(v) for r, v in by_resource.items()} == expected
    for resource, steps in by_resource.items():
        assert sorted(s for s, _ in steps) == list(range(len(steps))), (
            f"{resource} not once each: {steps}"
        )
        if not ordered:
            continue
        wrong = next((i for i, (s, a) in enumerate(steps) if (s, a) != (i, i - 1)), None)
        if wrong is not None:
            near = [(s, a, applier[(resource, s)]) for s, a in steps[max(0, wrong - 3) : wrong + 4]]
            raise AssertionError(
                f"{resource} applied out of order: {near} (seq, after, worker pid)"
            )


async def test_two_workers_split_partitions_keep_order_and_survive_a_kill(
    private_server: EmbeddedServer, own_pg: str, tmp_path: Path
) -> None:
    settings = load_settings({"nats_url": private_server.url, "partitions": 4}, env={})
    conn = await connect(settings, name="partition-test")
    await ensure(conn.js, default_streams(settings))
    publisher = Publisher(conn.js, settings)
    workers = [start_worker(private_server.url, own_pg, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        await wait_until(
            lambda: ensure_bucket_exists(conn.js), timeout=30, what="the ownership bucket"
        )
        kv = await conn.js.key_value(BUCKET)

        async def both_own() -> bool:
            # Numbered partitions on both sides: the spare "u" alone is not a share (one
            # worker holding p0-p3 and the other u passed this and applied nothing).
            found = await owners(kv)
            parts = {owner for slot, owner in found.items() if slot != "u"}
            return len(found) == 5 and len(parts) == 2

        await wait_until(both_own, timeout=30, what="both workers owning partitions")
        await publisher.publish_many(commands(20, range(20), settings))
        # Publishers that do not partition still reach the agent (five-token subjects).
        for seq in range(5):
            env = Envelope.new("seq.step", {"seq": seq}, resource_id="plain", source="test")
            await publisher.publish("cmd.default.test.seq.step", env)

        async def count(n: int) -> bool:
            return len(await stepped(conn)) >= n

        await wait_until(lambda: count(405), timeout=60, what="405 commands applied")
        first = await stepped(conn)
        check_order(first, 20, 20, {"plain": 5})
        assert len({e.payload["pid"] for e in first}) == 2, "both workers applied commands"

        # The second round is slow enough for the kill to land while it is in flight.
        await publisher.publish_many(commands(20, range(20, 40), settings, pause=0.004))
        await wait_until(lambda: count(405 + 80), timeout=60, what="the second round under way")
        victim, survivor = workers
        victim.kill()
        victim.wait()
        loop = asyncio.get_running_loop()
        killed = loop.time()

        async def survivor_owns_all() -> bool:
            found = await owners(kv)
            return (
                len(found) == 5
                and len(set(found.values())) == 1
                and str(survivor.pid) in next(iter(found.values()))
            )

        await wait_until(survivor_owns_all, timeout=30, what="the survivor owning every partition")
        assert loop.time() - killed < 1.5 + 4.5, "taken over within the lease and a few rounds"
        await wait_until(lambda: count(805), timeout=60, what="805 commands applied")
        events = await stepped(conn)
        # Exactly once through the kill, and in order: what the dead owner held (its ack
        # waits extended unevenly by in_progress) is taken back whole and sorted.
        check_order(events, 20, 40, {"plain": 5})
        assert len({e.id for e in events}) == len(events) == 805
        assert survivor.poll() is None
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        await conn.close()


async def test_a_stalled_owner_cannot_apply_commands_out_of_order(
    private_server: EmbeddedServer, own_pg: str, tmp_path: Path
) -> None:
    """An owner stopped (SIGSTOP) longer than its lease loses its partitions to the other
    worker; when it runs again it must not fetch from them any more: each resource's
    commands stay applied once each, in the order they were stored."""
    settings = load_settings({"nats_url": private_server.url, "partitions": 4}, env={})
    conn = await connect(settings, name="fencing-test")
    await ensure(conn.js, default_streams(settings))
    publisher = Publisher(conn.js, settings)
    fast = {"MESHFORGE_ACK_WAIT": "1s", "MESHFORGE_BATCH_SIZE": "4"}
    workers = [
        start_worker(private_server.url, own_pg, tmp_path / f"w{i}.log", **fast) for i in range(2)
    ]
    logs = {w.pid: tmp_path / f"w{i}.log" for i, w in enumerate(workers)}
    resources, published = 6, 0
    done = asyncio.Event()

    async def publish() -> None:
        nonlocal published
        while not done.is_set():
            await publisher.publish_many(
                commands(resources, range(published, published + 1), settings)
            )
            published += 1
            await asyncio.sleep(0.02)  # pacing: a steady stream of commands, not a wait

    async def holdings() -> dict[int, set[str]]:
        held: dict[int, set[str]] = {w.pid: set() for w in workers}
        for slot, owner in (await owners(kv)).items():
            for pid in held:
                if f"-{pid}-" in owner:
                    held[pid].add(slot)
        return held

    async def applied() -> int:
        return len(await stepped(conn))

    feeding: asyncio.Task[None] | None = None
    try:
        await wait_until(
            lambda: ensure_bucket_exists(conn.js), timeout=30, what="the ownership bucket"
        )
        kv = await conn.js.key_value(BUCKET)
        feeding = asyncio.create_task(publish())
        for cycle in range(3):
            victim, survivor = workers[cycle % 2], workers[1 - cycle % 2]

            async def shared() -> bool:
                held = await holdings()
                return all(held.values()) and sum(len(s) for s in held.values()) == len(SLOTS)

            await wait_until(
                shared, timeout=30, what=f"cycle {cycle}: both workers owning partitions"
            )
            taken = sorted(s for s in (await holdings())[victim.pid] if s != "u")
            started = {w.pid: pulls(logs[w.pid]) for w in workers}
            os.kill(victim.pid, signal.SIGSTOP)
            try:
                await wait_until(functools.partial(holdings_of, holdings, survivor.pid, len(SLOTS)), timeout=30,
                                 what=f"cycle {cycle}: the other worker owning every partition")  # fmt: skip
                # The new owner starts pulling them (it may not get far: the stopped worker
                # can hold the store's locks mid-transaction).
                await wait_until(functools.partial(pulling, logs[survivor.pid], taken, started[survivor.pid]), timeout=30,
                                 what=f"cycle {cycle}: the new owner pulling {taken}")  # fmt: skip
            finally:
                os.kill(victim.pid, signal.SIGCONT)
        done.set()
        await feeding
        total = published * resources
        await wait_until(
            lambda: at_least(applied, total), timeout=60, what=f"{total} commands applied"
        )
        check_order(await stepped(conn), resources, published, {})
        assert all(w.poll() is None for w in workers)
    finally:
        done.set()
        if feeding is not None:
            with contextlib.suppress(Exception):
                await feeding
        for proc in workers:
            stop_worker(proc)
        await conn.close()


def pulls(log: Path) -> Counter[str]:
    """How often each partition's consumer started pulling, from a worker's log."""
    found = re.findall(r"seq_consumer_(p\d+) pulling", log.read_text(errors="replace"))
    return Counter(found)


def pulling(log: Path, slots: list[str], before: Counter[str]) -> bool:
    now = pulls(log)
    return all(now[slot] > before[slot] for slot in slots)


async def holdings_of(holdings: Any, pid: int, count: int) -> bool:
    return len((await holdings())[pid]) == count


async def at_least(count: Any, n: int) -> bool:
    return bool(await count() >= n)


async def ensure_bucket_exists(js: Any) -> bool:
    try:
        await js.key_value(BUCKET)
    except Exception:
        return False
    return True


async def test_publish_adds_the_partition_token(nats_url: str, js: JetStreamContext) -> None:
    from typer.testing import CliRunner

    from meshforge.cli import app

    body = '{"type": "pubpart.create", "payload": {}, "resource_id": "order-7"}'
    env = {"MESHFORGE_PARTITIONS": "4", "MESHFORGE_NATS_URL": None, "MESHFORGE_CONFIG": None}
    result = await asyncio.to_thread(
        CliRunner().invoke,
        app,
        ["publish", "cmd.default.demo.pubpart.create", body, "--nats-url", nats_url],
        env=env,
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith("subject=cmd.default.demo.pubpart.create.3")
    stored = await js.get_last_msg(STREAM_COMMANDS, "cmd.default.demo.pubpart.create.3")
    assert decode(stored.data or b"", stored.headers or {}).resource_id == "order-7"
