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

    python benchmarks/bench_store.py [--batches 100] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
from _common import BODY_SIZE, console, machine
from _floors import floor
from rich.table import Table

from meshforge.store import NewEffect, NewEvent, NewState, Store, StoredOutput, open_store
from meshforge.topology.scope import DEFAULT_SCOPE

BATCH = 64
RESOURCES = 1000
AGENT = "bench"
CONSUMER = "bench_consumer"


def _batch(batch: int) -> tuple[list[str], list[str], list[NewEvent], dict[str, list[StoredOutput]]]:
    keys = [f"b{batch}-c{i}" for i in range(BATCH)]
    resources = sorted({f"r{(batch * BATCH + i * 7) % RESOURCES}" for i in range(BATCH)})
    body = b"x" * BODY_SIZE
    events = [
        NewEvent(f"{key}-e", "bench.done", resources[i % len(resources)], key, key, body, "2026-01-01T00:00:00Z")
        for i, key in enumerate(keys)
    ]
    outputs = {
        key: [
            StoredOutput(0, "evt.default.bench.bench.done", f"{key}-0", body, {"Nats-Msg-Id": f"{key}-0"}),
            StoredOutput(1, "cmd.default.bench.other.go", f"{key}-1", body, {"Nats-Msg-Id": f"{key}-1"}),
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
            stores = {"sqlite": open_store(f"sqlite:///{tmp}/store.db"), "postgresql": open_store(pg_url)}
            for n, (kind, path) in enumerate(runs):
                run(stores[kind], PATHS[path], 100_000 * (n + 1), 5)  # warm-up: tables, plans, pool
            for r in range(rounds):
                # Alternating, so load from other work on the machine falls on every store alike.
                for n, (kind, path) in enumerate(runs):
                    times[(kind, path)].append(run(stores[kind], PATHS[path], 1_000_000 * (n + 1) + r * batches, batches))
            for st in stores.values():
                st.close()
    finally:
        with psycopg.connect(pg_admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    commands = batches * BATCH
    rate = {k: statistics.median(commands / t for t in v) for k, v in times.items()}
    ratio = {
        path: statistics.median(s / p for s, p in zip(times[("sqlite", path)], times[("postgresql", path)], strict=True))
        for path in PATHS
    }
    table = Table(title=f"store path, batches of {BATCH} commands: {commands:,} commands, median of {rounds} rounds ({machine()})")
    for col in ("store", "methods", "commands/s", "ms per batch", "vs SQLite"):
        table.add_column(col, justify="left" if col in ("store", "methods") else "right")
    for kind, path in runs:
        table.add_row(kind, path, f"{rate[(kind, path)]:,.0f}", f"{BATCH / rate[(kind, path)] * 1000:.1f}",
                      f"{ratio[path] if kind == 'postgresql' else 1.0:.2f}x")  # fmt: skip
    console.print(table)
    # A diagnostic beside the floor: F4 is the agent's ratio, which bench_agent.py measures.
    floor("F4", "store path only: PostgreSQL vs SQLite (batches of 64)", f"{ratio['batch']:.2f}x", ">= 0.8x (agent)",
          met=None, note=f"diagnostic; single-row methods {ratio['by row']:.2f}x; the floor is bench_agent.py's")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/postgres", help="admin URL")
    parser.add_argument("--quick", action="store_true", help="30 batches, 3 rounds")
    args = parser.parse_args()
    main(30 if args.quick else args.batches, 3 if args.quick else args.rounds, args.pg)
