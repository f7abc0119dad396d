"""Publish throughput: MeshForge's Publisher and outbox relay against nats-py's ``publish_async``.

Every variant publishes the same N envelopes of 128-byte payloads with a Nats-Msg-Id to
its own fresh stream and waits for every PubAck, with the same number of PubAcks pending
(256). The variants take turns for ``--rounds`` rounds; the median of each counts.

- nats-py ``publish_async`` (its own pipelining, ``publish_async_max_pending=256``),
  then ``publish_async_completed()``: the baseline, on a stock nats-py client and on a
  MeshForge connection (``meshforge.transport.connection.connect``, as the worker and relay use);
- MeshForge ``Publisher.publish_many`` (retries, results, metrics) on each of the same
  two clients, and the outbox variants on the MeshForge connection;
- the outbox: 100 rows enqueued per SQLite transaction (``enqueue_many``: one INSERT)
  while an ``OutboxRelay`` publishes them, until every row is sent;
- the outbox relay alone, on N rows enqueued beforehand.

Floors (S0), each side on the same client: ``publish_many`` >= 0.9x ``publish_async`` on
stock nats-py and on MeshForge's connection; the outbox (enqueue + relay) >= 0.5x
``publish_async`` on MeshForge's connection, with the relay alone shown beside it.

    python benchmarks/bench_publish.py [--n 20000] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
from nats.js import JetStreamContext

sys.path.insert(0, str(Path(__file__).parent))
from _common import BODY_SIZE, console, machine
from _floors import floor
from rich.table import Table

from meshforge.config import load_settings
from meshforge.envelope import Envelope, Outbound
from meshforge.ops.observability import Metrics
from meshforge.publish.outbox import OutboxRelay, enqueue_many
from meshforge.publish.publisher import Publisher
from meshforge.store import open_store
from meshforge.store.base import Store
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer

PENDING = 256
ROWS_PER_TX = 100
VARIANTS = (
    "publish_async",
    "publish_many_nats",
    "publish_async_mf",
    "publish_many",
    "outbox",
    "relay",
)
LABELS = {
    "publish_async": f"nats-py publish_async ({PENDING} pending), stock client",
    "publish_many_nats": f"MeshForge publish_many ({PENDING} in flight), stock client",
    "publish_async_mf": "nats-py publish_async, MeshForge's connection",
    "publish_many": "MeshForge publish_many, MeshForge's connection",
    "outbox": f"outbox: enqueue {ROWS_PER_TX}/transaction + relay",
    "relay": "outbox relay alone (rows enqueued before)",
}


def envelopes(n: int, prefix: str) -> list[Envelope]:
    payload = {"blob": "x" * BODY_SIZE}
    return [Envelope.new("bench.publish", payload, id=f"{prefix}-{i}") for i in range(n)]


def fill_outbox(store: Store, subject: str, envs: list[Envelope]) -> None:
    for start in range(0, len(envs), ROWS_PER_TX):
        with store.transaction() as tx:
            enqueue_many(tx, [(subject, env) for env in envs[start : start + ROWS_PER_TX]])


async def relay_all(
    relay: OutboxRelay, n: int, fill: Callable[[int], Awaitable[None]] | None
) -> None:
    """Run ``relay`` until it sent ``n`` rows; ``fill(start)`` enqueues the rows from ``start`` meanwhile."""
    task = asyncio.create_task(relay.run())
    if fill is not None:
        for start in range(0, n, ROWS_PER_TX):
            await fill(start)
            relay.notify()
    for _ in range(1_000_000):
        if relay.sent_total >= n or task.done():
            break
        await asyncio.sleep(0.005)
    await relay.stop()
    await task


async def run_variant(
    variant: str,
    mf_js: JetStreamContext,
    async_js: JetStreamContext,
    subject: str,
    envs: list[Envelope],
    db: str,
    mf_async_js: JetStreamContext,
) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one variant publishing ``envs``."""
    items = [Outbound.of(subject, e) for e in envs]
    n = len(envs)
    store = open_store(db) if variant in ("outbox", "relay") else None
    if store is not None and variant == "relay":
        await asyncio.to_thread(fill_outbox, store, subject, envs)
    wall, cpu = time.perf_counter(), time.process_time()
    if variant in ("publish_async", "publish_async_mf"):
        pub_js = async_js if variant == "publish_async" else mf_async_js
        futures = [await pub_js.publish_async(m.subject, m.data, headers=m.headers) for m in items]
        await pub_js.publish_async_completed()
        for f in futures:
            f.result()
    elif variant == "publish_many":
        await Publisher(mf_js, metrics=Metrics()).publish_many(items, max_in_flight=PENDING)
    elif variant == "publish_many_nats":
        await Publisher(async_js, metrics=Metrics()).publish_many(items, max_in_flight=PENDING)
    else:
        assert store is not None
        relay = OutboxRelay(
            store, Publisher(mf_js, metrics=Metrics()), max_in_flight=PENDING, idle=0.05
        )

        async def fill(start: int) -> None:
            await asyncio.to_thread(fill_outbox, store, subject, envs[start : start + ROWS_PER_TX])

        await relay_all(relay, n, fill if variant == "outbox" else None)
    figures = time.perf_counter() - wall, time.process_time() - cpu
    if store is not None:
        store.close()
    return figures


async def one_round(
    js: JetStreamContext,
    mf_js: JetStreamContext,
    async_js: JetStreamContext,
    n: int,
    r: int,
    tmp: Path,
    sync: str,
    mf_async_js: JetStreamContext,
) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    for variant in VARIANTS:
        name = f"{variant}_{r}"
        subject = f"bench.{name}"
        await js.add_stream(name=name.upper(), subjects=[subject], duplicate_window=120)
        db = f"sqlite:///{tmp / name}.db?synchronous={sync}"
        out[variant] = await run_variant(
            variant, mf_js, async_js, subject, envelopes(n, name), db, mf_async_js
        )
        info = await js.stream_info(name.upper())
        assert info.state.messages == n, f"{name}: stored {info.state.messages} of {n}"
        await js.delete_stream(name.upper())
    return out


async def main(n: int, rounds: int, sync: str) -> None:
    runs: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    async with EmbeddedServer() as server:
        nc = await nats.connect(server.url)
        conn = await connect(load_settings({}, env={}), url=server.url)
        js = nc.jetstream()
        async_js = nc.jetstream(publish_async_max_pending=PENDING)
        mf_async_js = conn.nc.jetstream(publish_async_max_pending=PENDING)
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(rounds):
                for variant, figures in (
                    await one_round(js, conn.js, async_js, n, r, Path(tmp), sync, mf_async_js)
                ).items():
                    runs[variant].append(figures)
        await conn.close()
        await nc.close()
    rate = {v: statistics.median(n / w for w, _ in runs[v]) for v in VARIANTS}
    cpu = {v: statistics.median(c / n * 1e6 for _, c in runs[v]) for v in VARIANTS}

    def ratios_to(base: str) -> dict[str, float]:
        """Each variant over ``base``: the median of the per-round ratios."""
        return {
            v: statistics.median(b[0] / w for (w, _), b in zip(runs[v], runs[base], strict=True))
            for v in VARIANTS
        }

    stock, ours = ratios_to("publish_async"), ratios_to("publish_async_mf")
    table = Table(
        title=f"publish with PubAck: {n:,} messages, median of {rounds} alternating rounds ({machine()})"
    )
    for col in (
        "variant",
        "msgs/s",
        "client CPU us/msg",
        "vs publish_async (stock)",
        "vs publish_async (ours)",
    ):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v in VARIANTS:
        table.add_row(
            LABELS[v], f"{rate[v]:,.0f}", f"{cpu[v]:.0f}", f"{stock[v]:.2f}x", f"{ours[v]:.2f}x"
        )
    console.print(table)
    console.print(
        "each variant stored exactly n messages; ratio = median of the per-round ratios;"
        f" outbox store: SQLite, synchronous={sync}"
    )
    floor("S0", "publish_many vs publish_async, both on stock nats-py", f"{stock['publish_many_nats']:.2f}x", ">= 0.9x",
          met=stock["publish_many_nats"] >= 0.9)  # fmt: skip
    floor("S0", "publish_many vs publish_async, both on MeshForge's connection", f"{ours['publish_many']:.2f}x",
          ">= 0.9x", met=ours["publish_many"] >= 0.9)  # fmt: skip
    floor("S0", "outbox (enqueue + relay) vs publish_async, MeshForge's connection", f"{ours['outbox']:.2f}x", ">= 0.5x",
          met=ours["outbox"] >= 0.5, note=f"relay alone {ours['relay']:.2f}x; SQLite synchronous={sync}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--sync",
        choices=("full", "normal"),
        default="full",
        help="the outbox store's SQLite synchronous",
    )
    parser.add_argument("--quick", action="store_true", help="n = 2,000, 3 rounds")
    args = parser.parse_args()
    asyncio.run(main(2_000 if args.quick else args.n, 3 if args.quick else args.rounds, args.sync))
