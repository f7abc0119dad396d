"""Store bytes per command with retention: the store stays flat while commands go on.

One ``meshforge run`` worker drains N commands (one event out each, over 1,000
resources) with the retention shortened to 30 seconds (``effect_retention``,
``inbox_retention``; the worker deletes every 5 seconds; the duplicate window and the
redelivery span shortened to match). Every 4 seconds the store is measured by table,
for 100 seconds or until the commands are done:

- effects, their outputs and inbox rows: what retention bounds; once it deletes, their
  size stays flat however many commands go through (bytes per command in the window);
- the agent's event log and states: the agent's history, kept by design (bytes per
  command processed; states are bounded by the number of resources).

Floor (F7): bytes per command reported; the retained rows flat over time (once the
retention has started deleting, the last quarter's peak within 15% of the first half's).

    python benchmarks/bench_storage.py [--count 600000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import console, machine
from _drain import drain
from _floors import floor
from rich.table import Table

RETENTION = 30
SETTINGS = {
    "effect_retention": f"{RETENTION}s",
    "inbox_retention": f"{RETENTION}s",
    "retention_interval": "5s",
    "duplicate_window": "20s",
    "ack_wait": "5s",
    "max_deliver": 2,
    "backoff": "1s",
}


async def main(count: int) -> None:
    # The samples that count start RETENTION + 10 s in; a minute of them shows the trend,
    # however fast the machine drains (a slow one took 4 minutes for 600,000).
    result = await drain(count, SETTINGS, every=4.0, probe_store=True, enough=RETENTION + 70)
    table = Table(
        title=f"store size draining {count:,} commands, retention {RETENTION}s ({machine()})"
    )
    for col in ("s", "commands done", "effects kept", "effects+outputs+inbox MB", "B per kept command",
                "event log+states MB", "B per command done", "file+WAL MB"):  # fmt: skip
        table.add_column(col, justify="right")
    for s in result.samples:
        table.add_row(
            f"{s.seconds:.0f}", f"{s.done:,}", f"{s.effects:,}", f"{s.retained_bytes / 1e6:.1f}",
            f"{s.retained_bytes / s.effects if s.effects else 0:,.0f}", f"{s.kept_bytes / 1e6:.1f}",
            f"{s.kept_bytes / s.done if s.done else 0:,.0f}", f"{s.store_bytes / 1e6:.1f}",
        )  # fmt: skip
    console.print(table)
    last = result.samples[-1]
    per_kept = last.retained_bytes / last.effects if last.effects else 0.0
    per_done = last.kept_bytes / last.done if last.done else 0.0
    settled = [s for s in result.samples if s.seconds >= RETENTION + 10]
    if len(settled) >= 4:
        # The retained rows once the retention deletes: the first half's peak against the end's.
        second = max(s.retained_bytes for s in settled[: len(settled) // 2])
        end = max(s.retained_bytes for s in settled[len(settled) * 3 // 4 :])
        flat: bool | None = end <= second * 1.15
        note = (f"retained rows {end / 1e6:.1f} MB at the end vs {second / 1e6:.1f} MB earlier"
                f" ({'flat' if flat else 'growing'}); event log + states {per_done:,.0f} B per command, kept by design")  # fmt: skip
    else:
        flat, note = None, "run too short to see the retention at work: use a larger --count"
    console.print(f"{result.rate:,.0f} commands/s; {note}")
    floor("F7", "store bytes per command, retention on", f"{per_kept:,.0f} B/cmd in the window", "reported; flat over time",
          met=flat, note=note)  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=600_000)  # long enough to see retention delete
    parser.add_argument("--quick", action="store_true", help="20,000 commands")
    args = parser.parse_args()
    asyncio.run(main(20_000 if args.quick else args.count))
