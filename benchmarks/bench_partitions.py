"""Scale-out with partitions (F5): 1 and 2 (``--workers``) worker processes on one backlog,
order checked.

A backlog of N commands over R resources (N/R per resource, each carrying its sequence
number) waits on the partition durables, paused, while 1, 2 or 4 ``meshforge run
--partitions P`` processes start and share out the partitions. Then the durables are
resumed (and woken by one more command each: ``kicks``) and the clock runs until the
last event is stored. Every run gets a fresh
PostgreSQL database as the shared store (a partition that moves between workers keeps
its effects' history: one store for all), or with ``--store sqlite`` one shared SQLite
file; ``--store sqlite-per-worker`` (a diagnostic) gives each worker its own.

After each run the events are read back: every resource must have each command applied
once, in the order stored (each event names the sequence number it followed).

The CPU seconds of each worker process, nats-server and the run's PostgreSQL backends come
from /proc, with what the rest of the machine took meanwhile. F5 is the plain speed-up,
2 workers' rate over 1 worker's, printed with each process's CPU: a ratio of the run to
its own busy cores could not tell poor scaling from a full machine.

    python benchmarks/bench_partitions.py [--count 60000] [--resources 1000] [--workers 1,2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from _common import CpuMeter, console, machine
from _floors import floor

from meshforge.cli.demo_support import read_stream
from meshforge.config import Settings, load_settings
from meshforge.envelope import Envelope, Outbound, decode
from meshforge.publish.publisher import Publisher
from meshforge.topology.partitions import BUCKET, ensure_bucket, partition_of, partitioned
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams, partition_consumers
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_EVENTS
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
AGENT, SUBJECT = "bstep", "cmd.default.bench.bstep.step"
PG_ADMIN = os.environ.get("MESHFORGE_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
PARTITIONS = 16
# The default lease: a shorter one (1.5 s was tried) lets a worker starved of CPU by its
# neighbours renew late and lose partitions mid-run (docs/AGENTS.md, "What order").
LEASE = "6s"
KICK = "kick-"  # the resources of ``kicks``, outside the order check


def fresh_store(kind: str, tmp: Path, workers: int) -> tuple[list[str], str]:
    """The store URL of each worker, and the marker that names the run's PostgreSQL backends.

    ``sqlite-per-worker`` is a diagnostic: separate stores take the store's shared locks
    out of the picture. It is only sound here because no partition moves while measured.
    """
    run = uuid.uuid4().hex[:8]
    if kind == "sqlite":
        return [f"sqlite:///{tmp / f'store-{run}.db'}"] * workers, run
    if kind == "sqlite-per-worker":
        return [f"sqlite:///{tmp / f'store-{run}-{i}.db'}" for i in range(workers)], run
    import psycopg

    name = f"meshforge_bench_{run}"
    with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return [f"{PG_ADMIN.rsplit('/', 1)[0]}/{name}"] * workers, name


def postgres_reachable() -> bool:
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN, connect_timeout=3):
            return True
    except Exception:
        return False


def drop_store(kind: str, name: str) -> None:
    if kind == "postgres":
        import psycopg

        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def prepare(settings: Settings, count: int, resources: int) -> None:
    """Empty server state, the partition durables paused, and the backlog stored."""
    async with await connect(settings, name="bench-prepare") as conn:
        for info in await conn.js.streams_info():
            await conn.js.delete_stream(info.config.name)
        specs = list(partition_consumers(AGENT, settings).values())
        await ensure(conn.js, default_streams(settings), specs)
        await ensure_bucket(conn.js, settings)
        for spec in specs:
            await conn.js.pause_consumer(STREAM_COMMANDS, spec.durable, "2100-01-01T00:00:00Z")
        items = []
        for seq in range(count // resources):
            for r in range(resources):
                env = Envelope.new(
                    f"{AGENT}.step", {"seq": seq}, resource_id=f"r{r}", source="bench"
                )
                items.append(Outbound.of(partitioned(SUBJECT, env, settings), env))
        await Publisher(conn.js, settings).publish_many(items)


def start_workers(settings: Settings, stores: list[str]) -> list[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_")}
    env.update(
        PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{HERE}", MESHFORGE_PARTITION_LEASE=LEASE,
        MESHFORGE_LOG_LEVEL="WARNING", MESHFORGE_PROVISION="false",
    )  # fmt: skip
    args = ["run", "_partition_agent:StepAgent", "--partitions", str(settings.partitions),
            "--nats-url", settings.nats_url or ""]  # fmt: skip
    command = [sys.executable, "-m", "meshforge", *args, "--store"]
    return [
        subprocess.Popen([*command, store], env=env, stdout=subprocess.DEVNULL) for store in stores
    ]


async def settled(settings: Settings, workers: int, deadline: float) -> None:
    """Until every partition is owned and each worker owns its share, twice in a row
    (the unpartitioned slot, which no command of the run reaches, is not counted)."""
    slots = [slot for slot in partition_consumers(AGENT, settings) if slot != "u"]
    share = -(-len(slots) // workers)
    stable = 0
    async with await connect(settings, name="bench-watch") as conn:
        kv = await conn.js.key_value(BUCKET)
        while stable < 2:
            owners: dict[str, int] = defaultdict(int)
            for slot in slots:
                try:
                    entry = await kv.get(f"lease.{AGENT}_consumer.{slot}")
                    owners[(entry.value or b"").decode()] += 1
                except Exception:
                    pass
            full = sum(owners.values()) == len(slots) and len(owners) == workers
            stable = stable + 1 if full and max(owners.values()) <= share else 0
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"{workers} workers did not share out the partitions: {dict(owners)}"
                )
            await asyncio.sleep(0.5)  # polling the leases with a deadline


def kicks(settings: Settings) -> list[Outbound]:
    """One command for each partition, of a resource of its own (``KICK`` and a number).

    nats-server does not wake a resumed consumer: its pull requests, waiting since the
    pause, are served at the consumer's next idle heartbeat (up to a second later, each
    durable at its own time) or when a new message for it is stored. A command stored
    right after the resume is that message."""
    wanted, found, n = set(range(settings.partitions)), {}, 0
    while wanted:
        p = partition_of(f"{KICK}{n}", settings.partitions)
        if p in wanted:
            wanted.discard(p)
            env = Envelope.new(
                f"{AGENT}.step", {"seq": 0}, resource_id=f"{KICK}{n}", source="bench"
            )
            found[p] = Outbound.of(partitioned(SUBJECT, env, settings), env)
        n += 1
    return list(found.values())


async def drain(settings: Settings, count: int, deadline: float) -> float:
    """Resume the durables; seconds from then to the last event stored."""
    wake = kicks(settings)
    count += len(wake)
    async with await connect(settings, name="bench-drain") as conn:
        start = time.time()
        for spec in partition_consumers(AGENT, settings).values():
            await conn.js.resume_consumer(STREAM_COMMANDS, spec.durable)
        await Publisher(conn.js, settings).publish_many(wake)
        while (info := await conn.js.stream_info(STREAM_EVENTS)).state.messages < count:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"only {info.state.messages} of {count} events before the deadline"
                )
            await asyncio.sleep(0.05)  # polling the stream's count with a deadline
        return time.time() - start


async def check_order(settings: Settings, count: int, resources: int) -> None:
    """Each resource: every command applied once, in the order stored."""
    async with await connect(settings, name="bench-check") as conn:
        msgs = await read_stream(conn.js, STREAM_EVENTS, f"evt.*.*.{AGENT}.stepped")
    by_resource: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for msg in msgs:
        env = decode(msg.data, msg.headers)
        if (env.resource_id or "").startswith(KICK):
            continue
        by_resource[env.resource_id or ""].append((env.payload["seq"], env.payload["after"]))
    per = count // resources
    for resource, steps in by_resource.items():
        expected = [(s, s - 1) for s in range(per)]
        if steps != expected:
            raise SystemExit(
                f"resource {resource}: applied {steps[:8]}..., expected {expected[:8]}..."
            )
    kept = sum(len(steps) for steps in by_resource.values())
    if len(by_resource) != resources or kept != count:
        raise SystemExit(
            f"{kept} events over {len(by_resource)} resources, expected {count} over {resources}"
        )


def machine_busy() -> float:
    """CPU seconds every process on the machine has spent so far (from /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def one_run(
    server: EmbeddedServer, workers: int, count: int, resources: int, kind: str, tmp: Path
) -> tuple[float, dict[str, float]]:
    settings = load_settings(
        {"nats_url": server.url, "partitions": PARTITIONS, "partition_lease": LEASE}, env={}
    )
    stores, marker = fresh_store(kind, tmp, workers)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        asyncio.run(prepare(settings, count, resources))
        procs = start_workers(settings, stores)
        groups: dict[str, Callable[[int, str], bool]] = {
            f"worker {i}": (lambda pid, cmd, mine=proc.pid: pid == mine)
            for i, proc in enumerate(procs, 1)
        }
        groups["nats-server"] = lambda pid, cmd: pid == server.pid
        groups["store"] = lambda pid, cmd: cmd.startswith("postgres:") and marker in cmd
        asyncio.run(settled(settings, workers, time.monotonic() + 60))
        busy = machine_busy()
        with CpuMeter(groups) as cpu:
            seconds = asyncio.run(drain(settings, count, time.monotonic() + 600))
        # What the rest of the machine (other people's work) took meanwhile.
        others = max(0.0, machine_busy() - busy - sum(cpu.seconds.values()))
        asyncio.run(check_order(settings, count, resources))
        return seconds, {**cpu.seconds, "others": others}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        drop_store(kind, marker)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=60_000)
    parser.add_argument("--resources", type=int, default=1_000)
    parser.add_argument(
        "--store", choices=("postgres", "sqlite", "sqlite-per-worker"), default="postgres"
    )
    parser.add_argument("--workers", default="1,2", help="worker counts besides 1, e.g. 2,4")
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds of each worker count; the median counts"
    )
    parser.add_argument("--quick", action="store_true", help="count = 4,000")
    args = parser.parse_args()
    count = 4_000 if args.quick else args.count
    if args.store == "postgres" and not postgres_reachable():
        console.print(f"PostgreSQL is not reachable at {PG_ADMIN}: one shared SQLite file instead")
        args.store = "sqlite"
    count -= count % args.resources
    sizes = sorted({1, *(int(w) for w in args.workers.split(","))})
    rounds: list[dict[int, tuple[float, dict[str, float]]]] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedServer(store_dir=Path(tmp) / "nats") as server,
    ):
        for _ in range(max(1, args.rounds)):
            rounds.append(
                {w: one_run(server, w, count, args.resources, args.store, Path(tmp)) for w in sizes}
            )
    table = Table(title=f"Partitions ({PARTITIONS}), {count:,} commands over {args.resources:,} resources, "
                        f"{args.store} store ({machine()})")  # fmt: skip
    for column in ("round", "workers", "seconds", "cmd/s", "speed-up", "each worker's CPU s (cores)",
                   "nats-server CPU s", "store CPU s", "others' CPU", "order"):  # fmt: skip
        table.add_column(column, justify="right")
    for index, runs in enumerate(rounds, 1):
        one = runs[1][0]
        for workers, (seconds, cpu) in runs.items():
            table.add_row(
                str(index), str(workers), f"{seconds:.2f}", f"{count / seconds:,.0f}", f"{one / seconds:.2f}x",
                per_worker(cpu, seconds), f"{cpu.get('nats-server', 0):.1f}", f"{cpu.get('store', 0):.1f}",
                f"{cpu.get('others', 0) / seconds:.2f} cores", "kept",
            )  # fmt: skip
    Console(width=170).print(table)  # wide: one line per run even without a terminal
    for workers in sizes[1:]:
        # Each round against its own 1-worker run; the median speed-up counts.
        ups = sorted((runs[1][0] / runs[workers][0], index) for index, runs in enumerate(rounds))
        ratio, index = ups[len(ups) // 2]
        seconds, cpu = rounds[index][workers]
        one_seconds, one_cpu = rounds[index][1]
        spent = (f"CPU s: {per_worker(cpu, seconds)} vs {per_worker(one_cpu, one_seconds)} for 1 worker;"
                 f" nats-server {cpu.get('nats-server', 0):.1f} vs {one_cpu.get('nats-server', 0):.1f},"
                 f" {args.store} {cpu.get('store', 0):.1f} vs {one_cpu.get('store', 0):.1f};"
                 f" others {cpu.get('others', 0) / seconds:.2f} cores")  # fmt: skip
        console.print(
            f"F5 {workers} workers vs 1: {ratio:.2f}x ({count / seconds:,.0f} vs {count / one_seconds:,.0f} cmd/s); {spent}"
        )
        if workers == 2:
            floor("F5", f"2 workers vs 1, {PARTITIONS} partitions, shared {args.store}, order kept: plain speed-up",
                  f"{ratio:.2f}x", "reported", met=None, note=spent)  # fmt: skip


def per_worker(cpu: dict[str, float], seconds: float) -> str:
    """Each worker's CPU seconds and the cores that makes over the run."""
    mine = sorted((k, v) for k, v in cpu.items() if k.startswith("worker "))
    return " + ".join(f"{v:.1f} ({v / seconds:.2f})" for _, v in mine)


if __name__ == "__main__":
    main()
