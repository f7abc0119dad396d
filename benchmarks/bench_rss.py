"""Worker memory while draining a backlog: resident set size sampled through the run.

One ``meshforge run`` worker (SQLite store, default settings) drains N commands that
wait in the stream (one event out each); its RSS is read from /proc every two seconds.
``make bench`` drains 200,000; ``--count 1000000`` is the full run of the floor.

Floor (F6): RSS <= 150 MB and flat (the last quarter's peak within 10% of the second's).

    python benchmarks/bench_rss.py [--count 200000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import console, machine
from _drain import drain, quarter_max
from _floors import floor
from rich.table import Table


async def main(count: int) -> None:
    result = await drain(count, {}, every=2.0)
    table = Table(title=f"worker RSS draining {count:,} commands ({machine()})")
    for col in ("seconds", "commands done", "RSS MB"):
        table.add_column(col, justify="right")
    step = max(1, len(result.samples) // 12)
    for s in [*result.samples[::step], result.samples[-1]]:
        table.add_row(f"{s.seconds:.0f}", f"{s.done:,}", f"{s.rss_mb:.0f}")
    console.print(table)
    peak = max(s.rss_mb for s in result.samples)
    second, last = (
        quarter_max(result.samples, "rss_mb", 1),
        quarter_max(result.samples, "rss_mb", 3),
    )
    flat = last <= second * 1.10
    console.print(
        f"{result.rate:,.0f} commands/s; peak RSS {peak:.0f} MB; second-quarter peak {second:.0f} MB, last-quarter peak {last:.0f} MB"
    )
    floor("F6", f"worker RSS draining {count:,} commands", f"{peak:.0f} MB", "<= 150 MB and flat", met=peak <= 150 and flat,
          note=f"second-quarter peak {second:.0f} MB, last {last:.0f} MB ({'flat' if flat else 'growing'})")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--quick", action="store_true", help="20,000 commands")
    args = parser.parse_args()
    asyncio.run(main(20_000 if args.quick else args.count))
