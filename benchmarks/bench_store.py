"""The store path of the effect loop: SQLite against PostgreSQL, batch by batch.

Each batch is what the engine does for 64 commands (one event and two outputs each, on
64 of 1,000 resources): one transaction reads the resources' states and the commands'
effects, stores the effects with their outputs, marks the previous batch's effects
published, appends the events and writes the states. "batch" does it with the store's
batch methods (a few statements a batch, as the engine does); "by row" with the
single-row methods (several statements a command, marking in a second transaction).
Stores and methods take turns for ``--rounds`` rounds; the median counts. PostgreSQL runs on 127.0.0.1:5432 (``--pg`` to change), in a
database made for the run and dropped after.

F4 (PostgreSQL >= 0.8x SQLite) is the agent's floor, measured by ``bench_agent.py``; this
script prints the store path's ratio beside it as a diagnostic.

``--stage`` measures instead the CPU the agent's store side spends a command, with no
server: the engine's store stage (``Engine._run_here``: BEGIN, read the states and
effects, run the handlers, build the outputs, store it all, COMMIT) over groups of
synthetic commands already decoded, of the size a backlog gives (``4 x batch_size``, 256),
the previous group's keys marked published in each, on a SQLite store with
``synchronous=full`` as the agent runs it. It prints the stage thread's CPU a command
(``time.thread_time``) and the whole process's (``time.process_time``: with SQLite's
checkpoint thread), the median of ``--rounds`` rounds, each on a fresh store. Each round
then runs the same groups a second time, on another fresh store whose WAL is never
checkpointed (the checkpoint thread stopped, ``wal_autocheckpoint = 0``), and prints the
bytes the measured groups added to the ``-wal`` file a command: every frame a commit
writes is appended there (4,096 + 24 bytes a page), so its growth is the WAL the
commits wrote. (With checkpoints the WAL starts again from its beginning now and then,
and its size says nothing; the frames a commit writes do not depend on them.)

    python benchmarks/bench_store.py [--batches 100] [--rounds 3] [--quick]   # then the stage, W1
    python benchmarks/bench_store.py --stage [--groups 40] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
from _common import BODY_SIZE, console, machine
from _floors import floor
from rich.table import Table

from meshforge.config import Settings
from meshforge.consume.decisions import Delivery
from meshforge.envelope import Outbound, decode
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.runtime.effects import Work
from meshforge.runtime.engine import Engine
from meshforge.store import NewEffect, NewEvent, NewState, Store, StoredOutput, open_store
from meshforge.topology.scope import DEFAULT_SCOPE, Scope

BATCH = 64
RESOURCES = 1000
AGENT = "bench"
CONSUMER = "bench_consumer"


def _batch(
    batch: int,
) -> tuple[list[str], list[str], list[NewEvent], dict[str, list[StoredOutput]]]:
    keys = [f"b{batch}-c{i}" for i in range(BATCH)]
    resources = sorted({f"r{(batch * BATCH + i * 7) % RESOURCES}" for i in range(BATCH)})
    body = b"x" * BODY_SIZE
    events = [
        NewEvent(
            f"{key}-e",
            "bench.done",
            resources[i % len(resources)],
            key,
            key,
            body,
            "2026-01-01T00:00:00Z",
        )
        for i, key in enumerate(keys)
    ]
    outputs = {
        key: [
            StoredOutput(
                0, "evt.default.bench.bench.done", f"{key}-0", body, {"Nats-Msg-Id": f"{key}-0"}
            ),
            StoredOutput(
                1, "cmd.default.bench.other.go", f"{key}-1", body, {"Nats-Msg-Id": f"{key}-1"}
            ),
        ]
        for key in keys
    }
    return keys, resources, events, outputs


def one_batch_by_row(store: Store, batch: int) -> None:
    """The single-row methods: a statement or two per command, a second transaction to mark."""
    keys, resources, events, outputs = _batch(batch)
    with store.transaction() as tx:
        states = {r: tx.state_get(AGENT, r) for r in resources}
        for key in keys:
            tx.effect_get(CONSUMER, key)
        positions = tx.events_append(AGENT, events)
        for resource, position in zip(resources, positions, strict=False):
            tx.state_put(AGENT, resource, (states[resource] or b"")[:64] + b"s", position)
        for key in keys:
            tx.effect_put(CONSUMER, key, key, outputs[key])
    with store.transaction() as tx:
        for key in keys:
            tx.effect_mark_published(CONSUMER, key)


def one_batch(store: Store, batch: int) -> None:
    """The batch methods, as the engine uses them: the previous batch's published marks ride
    along, and the event log's head is taken last."""
    keys, resources, events, outputs = _batch(batch)
    scope = DEFAULT_SCOPE
    with store.transaction() as tx:
        states = tx.states_get(AGENT, [(scope, r) for r in resources])
        tx.effects_get(CONSUMER, [(scope, k) for k in keys])
        tx.effects_put(CONSUMER, [NewEffect(k, k, outputs[k], scope) for k in keys])
        tx.effects_mark_published(CONSUMER, [(scope, f"b{batch - 1}-c{i}") for i in range(BATCH)])
        positions = tx.events_append(AGENT, events)
        tx.states_put(
            AGENT,
            [
                NewState(r, (states[(scope, r)] or b"")[:64] + b"s", position, scope)
                for r, position in zip(resources, positions, strict=False)
            ],
        )


PATHS: dict[str, Callable[[Store, int], None]] = {"batch": one_batch, "by row": one_batch_by_row}


def run(store: Store, path: Callable[[Store, int], None], first: int, batches: int) -> float:
    """Seconds for ``batches`` batches."""
    started = time.perf_counter()
    for b in range(first, first + batches):
        path(store, b)
    return time.perf_counter() - started


def main(batches: int, rounds: int, pg_admin: str) -> None:
    name = f"meshforge_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    pg_url = pg_admin.rsplit("/", 1)[0] + f"/{name}"
    runs = [(kind, path) for path in PATHS for kind in ("sqlite", "postgresql")]
    times: dict[tuple[str, str], list[float]] = {r: [] for r in runs}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            stores = {
                "sqlite": open_store(f"sqlite:///{tmp}/store.db"),
                "postgresql": open_store(pg_url),
            }
            for n, (kind, path) in enumerate(runs):
                run(stores[kind], PATHS[path], 100_000 * (n + 1), 5)  # warm-up: tables, plans, pool
            for r in range(rounds):
                # Alternating, so load from other work on the machine falls on every store alike.
                for n, (kind, path) in enumerate(runs):
                    times[(kind, path)].append(
                        run(stores[kind], PATHS[path], 1_000_000 * (n + 1) + r * batches, batches)
                    )
            for st in stores.values():
                st.close()
    finally:
        with psycopg.connect(pg_admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    commands = batches * BATCH
    rate = {k: statistics.median(commands / t for t in v) for k, v in times.items()}
    ratio = {
        path: statistics.median(
            s / p for s, p in zip(times[("sqlite", path)], times[("postgresql", path)], strict=True)
        )
        for path in PATHS
    }
    table = Table(
        title=f"store path, batches of {BATCH} commands: {commands:,} commands, median of {rounds} rounds ({machine()})"
    )
    for col in ("store", "methods", "commands/s", "ms per batch", "vs SQLite"):
        table.add_column(col, justify="left" if col in ("store", "methods") else "right")
    for kind, path in runs:
        table.add_row(kind, path, f"{rate[(kind, path)]:,.0f}", f"{BATCH / rate[(kind, path)] * 1000:.1f}",
                      f"{ratio[path] if kind == 'postgresql' else 1.0:.2f}x")  # fmt: skip
    console.print(table)
    # A diagnostic beside the floor: F4 is the agent's ratio, which bench_agent.py measures.
    floor("F4", "store path only: PostgreSQL vs SQLite (batches of 64)", f"{ratio['batch']:.2f}x", ">= 0.9x (agent)",
          met=None, note=f"diagnostic; single-row methods {ratio['by row']:.2f}x; the floor is bench_agent.py's")  # fmt: skip


STAGE_SUBJECT = "cmd.default.bench.echo.work"
_FRAME = 4096 + 24  # a WAL frame: a page and its header
W1_FLOOR_KB = 3.0  # WAL a command (docs/STORE.md, "The layout written in sequence")


def _stage_group(engine: Engine[Any], first: int, size: int) -> list[Work]:
    """``size`` commands as the consumer hands them over: decoded, admitted, in stream order."""
    from _variants import command_body

    blob = "x" * BODY_SIZE
    stamp = datetime.now(UTC)
    works: list[Work] = []
    for i in range(size):
        sent = Outbound.of(STAGE_SUBJECT, command_body(blob))
        env = decode(sent.data, sent.headers)
        delivery = Delivery(
            msg=None, subject=STAGE_SUBJECT, data=sent.data, headers=dict(sent.headers),  # type: ignore[arg-type]
            stream="MESHFORGE_COMMANDS", seq=first + i, num_delivered=1, timestamp=stamp, envelope=env,
        )  # fmt: skip
        work = engine._admit(i, delivery)
        assert isinstance(work, Work), work
        work.index = i
        works.append(work)
    return works


def stage_round(
    groups: int, size: int, tmp: str, *, wal: bool = False
) -> tuple[float, float, dict[str, float]]:
    """(stage thread, whole process) CPU microseconds a command over ``groups`` groups, and
    the process's system-call I/O a command (``_io``). With ``wal``, the WAL is never
    checkpointed and the I/O has ``wal``: the bytes the groups added to it a command."""
    from _variants import EchoAgent

    settings = Settings()
    path = Path(tmp) / "stage.db"
    store = open_store(f"sqlite:///{path}")
    if wal:
        _no_checkpoints(store)
    publisher = Publisher(None, settings, Metrics.default())  # type: ignore[arg-type]  # only its limits
    engine = Engine(EchoAgent(), store, publisher, settings=settings)
    wal_file = path.with_name(path.name + "-wal")
    try:
        marks: list[tuple[Scope, str]] = []
        thread = process = building = 0.0
        io = _io()
        wal_start = wal_last = 0
        for g in range(groups + 2):  # two to warm up: tables, statements
            if wal and g == 2:
                wal_start = wal_file.stat().st_size
            if wal and g == groups + 1:
                wal_last = wal_file.stat().st_size
            started = time.thread_time(), time.process_time()
            works = _stage_group(engine, 1 + g * size, size)  # the event loop's part: not counted
            ran = time.thread_time()
            engine._run_here(works, marks)
            marks = [(w.scope, w.env.key) for w in works]
            if g >= 2:
                building += ran - started[0]
                thread += time.thread_time() - ran
                process += time.process_time() - started[1]
            del works
        # The whole process's CPU over the groups run (its checkpoint thread's too), less
        # what building the commands took.
        process -= building
        io = {k: v - io.get(k, 0) for k, v in _io().items()}
        if wal:
            io["wal"] = wal_file.stat().st_size - wal_start
            # The last group's bytes, a command of it once divided by n below.
            io["wal_last"] = (wal_file.stat().st_size - wal_last) * groups
    finally:
        engine.close()
        store.close()
    n = groups * size
    return thread / n * 1e6, process / n * 1e6, {k: v / n for k, v in io.items()}


def _no_checkpoints(store: Store) -> None:
    """Stop the SQLite store's checkpoints: every frame its commits write stays in the WAL."""
    checkpointer = getattr(store, "_checkpointer", None)
    if checkpointer is not None:
        checkpointer.close()
        store._checkpointer = None  # type: ignore[attr-defined]  # closed again by close()
    store._conn.execute("PRAGMA wal_autocheckpoint = 0")  # type: ignore[attr-defined]


def _io() -> dict[str, int]:
    """The process's bytes read and written by system calls, and the calls (Linux)."""
    path = Path("/proc/self/io")
    if not path.exists():
        return {}
    pairs = (line.split(": ") for line in path.read_text().splitlines())
    return {k: int(v) for k, v in pairs if k in ("rchar", "wchar", "syscr", "syscw")}


def stage(groups: int, rounds: int) -> None:
    size = 4 * Settings().batch_size
    threads: list[float] = []
    processes: list[float] = []
    ios: list[dict[str, float]] = []
    wals: list[float] = []
    lasts: list[float] = []
    for r in range(rounds):
        with tempfile.TemporaryDirectory(prefix="meshforge-stage-") as tmp:
            thread, process, io = stage_round(groups, size, tmp)
        with tempfile.TemporaryDirectory(prefix="meshforge-stage-wal-") as tmp:
            walled = stage_round(groups, size, tmp, wal=True)[2]
        wal, last = walled["wal"], walled["wal_last"]
        threads.append(thread)
        processes.append(process)
        ios.append(io)
        wals.append(wal)
        lasts.append(last)
        console.print(
            f"round {r + 1}: stage thread {thread:.1f} us/cmd, process {process:.1f} us/cmd;"
            f" a command read {io.get('rchar', 0):,.0f} B in {io.get('syscr', 0):.2f} calls,"
            f" wrote {io.get('wchar', 0):,.0f} B in {io.get('syscw', 0):.2f};"
            f" WAL {wal / 1000:.2f} KB ({wal / _FRAME:.2f} frames), in the last group"
            f" {last / 1000:.2f} KB ({last * size / _FRAME:.0f} frames its commit)"
        )
    io = {k: statistics.median(i[k] for i in ios) for k in ios[0]}
    wal, last = statistics.median(wals), statistics.median(lasts)
    console.print(
        f"store stage, {groups} groups of {size} commands, median of {rounds}: stage thread"
        f" {statistics.median(threads):.1f} us/cmd (least {min(threads):.1f}), process"
        f" {statistics.median(processes):.1f} us/cmd (least {min(processes):.1f}); I/O a command:"
        f" read {io.get('rchar', 0):,.0f} B, wrote {io.get('wchar', 0):,.0f} B; WAL a command"
        f" {wal / 1000:.2f} KB, {wal / _FRAME:.2f} frames (-wal growth, not checkpointed),"
        f" in the last group {last / 1000:.2f} KB ({last * size / _FRAME:.0f} frames its commit)"
        f" ({machine()})"
    )
    floor("W1", f"WAL a command, the agent's store stage ({groups} groups of {size} from empty)",
          f"{wal / 1000:.2f} KB", f"<= {W1_FLOOR_KB} KB", met=wal / 1000 <= W1_FLOOR_KB,
          note=f"{last / 1000:.2f} KB a command in the last group's commit")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=None, help="3 (store path) or 5 (--stage)")
    parser.add_argument(
        "--pg", default="postgresql://postgres@127.0.0.1:5432/postgres", help="admin URL"
    )
    parser.add_argument("--quick", action="store_true", help="30 batches, 3 rounds")
    parser.add_argument(
        "--stage", action="store_true", help="the agent's store stage: CPU a command, no server"
    )
    parser.add_argument("--groups", type=int, default=40, help="with --stage: groups a round")
    args = parser.parse_args()
    if args.stage:
        stage(args.groups, args.rounds or 5)
        sys.exit(0)
    main(30 if args.quick else args.batches, 3 if args.quick else args.rounds or 3, args.pg)
    # ``make bench`` runs this script plain: the store stage's WAL (W1) follows the batches.
    stage(10 if args.quick else args.groups, 1 if args.quick else 3)
