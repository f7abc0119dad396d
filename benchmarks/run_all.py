"""Run every benchmark script in this folder, one after the other, then print every floor.

Each ``bench_*.py`` starts its own embedded nats-server, measures MeshForge against a
baseline in the same run and prints its figures; a script prints each floor it measures
as an ``@floor`` line (see ``_floors.py``), and this runner collects them into one
table at the end, S0 to S7, with a row for every floor no script reported. A script
that fails is run once more (a loaded machine can fail a set-up); if it fails again,
the others still run and the exit status says so.

    python benchmarks/run_all.py [--quick] [--only publish,store]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _floors import parse

# Every floor of the speed targets, in order; the scripts fill them in.
FLOORS = {
    "S0": "publish_many vs publish_async (>= 0.9x); outbox relay vs the same (>= 0.5x)",
    "S1": "exactly-once agent, backlog, SQLite, vs the plain nats-py loop (>= 0.6x)",
    "S2": "the same vs FastStream publishing one output (>= 3x)",
    "S3": "open loop 1,000 cmd/s for 30 s: p50 <= 3 ms, p99 <= 15 ms",
    "S4": "PostgreSQL store vs SQLite store (>= 0.7x)",
    "S5": "2 workers vs 1 with partitions, per-resource order (>= 90% of the CPU ceiling)",
    "S6": "worker RSS draining commands (<= 150 MB and flat)",
    "S7": "store bytes per command after retention (reported; flat)",
    "C1": "console dead-letter list with 1,000,000 letters stored (< 1 s)",
}


def run(script: Path, args: list[str]) -> tuple[int, list[dict[str, object]]]:
    """Run one script, echoing its output; its exit code and the floors it printed."""
    found: list[dict[str, object]] = []
    with subprocess.Popen(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            floor = parse(line)
            if floor is None:
                print(line, end="", flush=True)
            else:
                found.append(floor)
        return proc.wait(), found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes in every script")
    parser.add_argument("--only", default="", help="comma-separated script names without bench_, e.g. publish,store")
    args = parser.parse_args()
    here = Path(__file__).parent
    wanted = {f"bench_{name.strip()}.py" for name in args.only.split(",") if name.strip()}
    failed: list[str] = []
    floors: list[dict[str, object]] = []
    took: dict[str, float] = {}
    started = time.monotonic()
    for script in sorted(here.glob("bench_*.py")):
        if wanted and script.name not in wanted:
            continue
        began = time.monotonic()
        for attempt in (1, 2):
            print(f"\n=== {script.name}{' (again)' if attempt == 2 else ''} ===", flush=True)
            rc, found = run(script, ["--quick"] if args.quick else [])
            if rc == 0:
                floors.extend(found)
                break
        else:
            failed.append(script.name)
        took[script.name] = time.monotonic() - began
    print("\n=== minutes per script ===")
    print("  ".join(f"{name.removeprefix('bench_').removesuffix('.py')} {t / 60:.1f}" for name, t in took.items()))
    summary(floors, time.monotonic() - started)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
        return 1
    return 0


def summary(floors: list[dict[str, object]], seconds: float) -> None:
    print(f"\n=== floors (all benchmarks took {seconds / 60:.1f} min) ===")
    rows = [("id", "what", "value", "floor", "met", "note")]
    for fid, what in FLOORS.items():
        mine = [f for f in floors if f.get("id") == fid]
        if not mine:
            rows.append((fid, what, "-", "", "not measured", "no benchmark reported it"))
        for f in mine:
            met = f.get("met")
            verdict = "yes" if met is True else "NO" if met is False else "n/a"
            rows.append((fid, str(f.get("what")), str(f.get("value")), str(f.get("target")), verdict, str(f.get("note") or "")))
    for f in floors:
        if f.get("id") not in FLOORS:
            rows.append((str(f.get("id")), str(f.get("what")), str(f.get("value")), str(f.get("target")),
                         "yes" if f.get("met") else "NO", str(f.get("note") or "")))  # fmt: skip
    widths = [max(len(r[i]) for r in rows[:]) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + (f"  {r[5]}" if r[5] else ""))


if __name__ == "__main__":
    raise SystemExit(main())
