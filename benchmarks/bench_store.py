"""The store path of the effect loop: SQLite against PostgreSQL, batch by batch.

Each batch is what the engine does for 64 commands (one event and two outputs each, on
64 of 1,000 resources): one transaction reads the resources' states and the commands'
effects, appends the events, writes the states and stores the effects with their
outputs; a second marks the effects published. The stores take turns for ``--rounds``
rounds; the median counts. PostgreSQL runs on 127.0.0.1:5432 (``--pg`` to change), in a
database made for the run and dropped after.

Floor (S4, store path): PostgreSQL >= 0.7x SQLite.

    python benchmarks/bench_store.py [--batches 150] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
from _common import BODY_SIZE, console, machine
from _floors import floor
from rich.table import Table

from meshforge.store import NewEvent, Store, StoredOutput, open_store

BATCH = 64
RESOURCES = 1000
AGENT = "bench"
CONSUMER = "bench_consumer"


def one_batch(store: Store, batch: int) -> None:
    keys = [f"b{batch}-c{i}" for i in range(BATCH)]
    resources = sorted({f"r{(batch * BATCH + i * 7) % RESOURCES}" for i in range(BATCH)})
    body = b"x" * BODY_SIZE
    with store.transaction() as tx:
        states = {r: tx.state_get(AGENT, r) for r in resources}
        for key in keys:
            tx.effect_get(CONSUMER, key)
        events = [
            NewEvent(f"{key}-e", "bench.done", resources[i % len(resources)], key, key, body, "2026-01-01T00:00:00Z")
            for i, key in enumerate(keys)
        ]
        positions = tx.events_append(AGENT, events)
        for resource, position in zip(resources, positions, strict=False):
            tx.state_put(AGENT, resource, (states[resource] or b"") [:64] + b"s", position)
        for key in keys:
            outputs = [
                StoredOutput(0, "evt.default.bench.bench.done", f"{key}-0", body, {"Nats-Msg-Id": f"{key}-0"}),
                StoredOutput(1, "cmd.default.bench.other.go", f"{key}-1", body, {"Nats-Msg-Id": f"{key}-1"}),
            ]
            tx.effect_put(CONSUMER, key, key, outputs)
    with store.transaction() as tx:
        for key in keys:
            tx.effect_mark_published(CONSUMER, key)


def run(store: Store, first: int, batches: int) -> float:
    """Seconds for ``batches`` batches."""
    started = time.perf_counter()
    for b in range(first, first + batches):
        one_batch(store, b)
    return time.perf_counter() - started


def main(batches: int, rounds: int, pg_admin: str) -> None:
    name = f"meshforge_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    pg_url = pg_admin.rsplit("/", 1)[0] + f"/{name}"
    times: dict[str, list[float]] = {"sqlite": [], "postgresql": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            stores = {"sqlite": open_store(f"sqlite:///{tmp}/store.db"), "postgresql": open_store(pg_url)}
            for st in stores.values():
                run(st, 0, 5)  # warm-up: tables, plans, pool
            for r in range(rounds):
                for kind, st in stores.items():
                    times[kind].append(run(st, 1000 + r * batches, batches))
            for st in stores.values():
                st.close()
    finally:
        with psycopg.connect(pg_admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    commands = batches * BATCH
    rate = {k: statistics.median(commands / t for t in v) for k, v in times.items()}
    ratio = statistics.median(s / p for s, p in zip(times["sqlite"], times["postgresql"], strict=True))
    table = Table(title=f"store path, batches of {BATCH} commands: {commands:,} commands, median of {rounds} rounds ({machine()})")
    for col in ("store", "commands/s", "ms per batch", "vs SQLite"):
        table.add_column(col, justify="left" if col == "store" else "right")
    for kind in times:
        table.add_row(kind, f"{rate[kind]:,.0f}", f"{BATCH / rate[kind] * 1000:.1f}", f"{rate[kind] / rate['sqlite']:.2f}x")
    console.print(table)
    floor("S4", "store path: PostgreSQL vs SQLite (batches of 64)", f"{ratio:.2f}x", ">= 0.7x", met=ratio >= 0.7,
          note="store path only; the agent benchmark gives the end-to-end figure")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/postgres", help="admin URL")
    parser.add_argument("--quick", action="store_true", help="30 batches, 3 rounds")
    args = parser.parse_args()
    main(30 if args.quick else args.batches, 3 if args.quick else args.rounds, args.pg)
