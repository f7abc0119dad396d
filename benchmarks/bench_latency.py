"""S3: end-to-end latency under a steady open-loop load, through the exactly-once agent and
through the plain nats-py loop, each worker one process.

A separate generator process publishes commands at a fixed rate (open loop: each leaves
on schedule whether or not earlier ones are done), each stamped with the machine's
monotonic clock; this process times every output's arrival against its stamp. The first
second of each run is warm-up and not counted.

The highest rate runs ``--rounds`` times (3 by default) and its medians count: one stall
of the machine (tens of ms, now and then on a shared 2-core VM) moves a single run's
p99 at 1,000/s past the floor. Lower rates run once, for half of ``--seconds``.

    python benchmarks/bench_latency.py [--rates 250,1000] [--seconds 30] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _agents import HERE, LABELS, bench, wait_for
from _common import BODY_SIZE, console, machine
from _floors import floor
from _variants import command_body
from rich.table import Table

from meshforge.publisher import Publisher

P50_FLOOR_MS, P99_FLOOR_MS = 3.0, 15.0
WARMUP = 1.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_once(kind: str, rate: int, seconds: float, work: Path) -> tuple[float, float, int]:
    """(p50 ms, p99 ms, outputs counted) for one variant at one rate."""
    async with bench(kind, work) as b:
        inp, _ = b.subjects
        total = int(rate * seconds)
        tap = await b.tap(total + 1)
        b.start()
        # Ready when one command has gone all the way through.
        probe = asyncio.Event()
        tap.wanted = 1
        tap.full = probe
        await Publisher(b.nc.jetstream()).publish(inp, command_body("x" * BODY_SIZE, time.monotonic()))
        await wait_for(probe, 60, "a first output", b)
        tap.wanted, tap.full = total + 1, asyncio.Event()
        tap.latencies.clear()
        tap.sent.clear()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        start = time.monotonic()
        gen = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE / "_variants.py"), "load", b.server.url, inp, str(rate), str(seconds), str(BODY_SIZE),
            env=env,
        )  # fmt: skip
        try:
            await wait_for(tap.full, seconds + 60, f"{total} outputs", b)
        finally:
            await asyncio.wait_for(gen.wait(), 30)
        # Latencies of commands sent after the warm-up (the stamp is its send time; the
        # generator builds its commands before it sends the first).
        first = min(tap.sent, default=start)
        counted = [lat for lat, sent in zip(tap.latencies, tap.sent, strict=True) if sent >= first + WARMUP]
        return percentile(counted, 0.5) * 1e3, percentile(counted, 0.99) * 1e3, len(counted)


async def main(rates: list[int], seconds: float, rounds: int, kinds: list[str]) -> None:
    def span(rate: int) -> float:
        """``seconds`` at the highest rate (the floor's), half that below it."""
        return seconds if rate == max(rates) else seconds / 2

    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="meshforge-latency-") as tmp:
        for r in range(rounds):
            for rate in rates if r == 0 else [max(rates)]:
                for kind in kinds if r % 2 == 0 else list(reversed(kinds)):
                    p50, p99, n = await run_once(kind, rate, span(rate), Path(tmp) / f"{kind}{rate}r{r}")
                    results.setdefault((kind, rate), []).append((p50, p99))
                    console.print(f"round {r + 1} {kind} {rate}/s: p50 {p50:.2f} ms, p99 {p99:.2f} ms ({n:,} counted)")
    table = Table(title=f"open-loop latency, publish to output arrival, {seconds:g} s per run at the top rate ({machine()})")
    for col in ("variant", "rate", "p50 ms", "p99 ms"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for (kind, rate), values in results.items():
        p50 = statistics.median(v[0] for v in values)
        p99 = statistics.median(v[1] for v in values)
        table.add_row(LABELS[kind], f"{rate:,}/s", f"{p50:.2f}", f"{p99:.2f}")
    console.print(table)
    for rate in rates:
        if ("mf", rate) not in results:
            continue
        p50 = statistics.median(v[0] for v in results[("mf", rate)])
        p99 = statistics.median(v[1] for v in results[("mf", rate)])
        base = results.get(("raw", rate))
        beside = ""
        if base:
            beside = (f"nats-py loop p50 {statistics.median(v[0] for v in base):.2f} ms,"
                      f" p99 {statistics.median(v[1] for v in base):.2f} ms")  # fmt: skip
        runs = results[("mf", rate)]
        if len(runs) > 1:
            beside += f"; median of {len(runs)} runs (" + ", ".join(f"{a:.2f} / {b:.2f}" for a, b in runs) + " ms)"
        floor("S3", f"open loop {rate:,} cmd/s, {span(rate):g} s, publish to output", f"p50 {p50:.2f} ms, p99 {p99:.2f} ms",
              f"p50 <= {P50_FLOOR_MS:g} ms, p99 <= {P99_FLOOR_MS:g} ms",
              met=p50 <= P50_FLOOR_MS and p99 <= P99_FLOOR_MS, note=beside)  # fmt: skip

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", default="250,1000")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=3, help="runs at the highest rate; the median counts")
    parser.add_argument("--only", default="mf,raw", help="variants, comma-separated")
    parser.add_argument("--quick", action="store_true", help="5 s per run")
    args = parser.parse_args()
    seconds = 5.0 if args.quick else args.seconds
    asyncio.run(main([int(r) for r in args.rates.split(",")], seconds, args.rounds, args.only.split(",")))
