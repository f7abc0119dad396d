"""Run every benchmark script in this folder, one after the other, then print every floor.

Each ``bench_*.py`` starts its own embedded nats-server, measures MeshForge against a
baseline in the same run and prints its figures; a script prints each floor it measures
as an ``@floor`` line (see ``_floors.py``), and this runner collects them into one
table at the end, S0, F1 to F7, W1, W2, C1, T1, T2 and N1 to N7, with a row for every floor no script reported. A
script that fails is not run again: its floors show as FAILED in the table (with its
exit status), the others still run, and the exit status says so.

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

# Every floor of the speed targets, in order, and the script that measures it.
FLOORS = {
    "S0": (
        "publish_many vs publish_async on the same client (>= 0.9x); outbox relay vs the same (>= 0.5x)",
        "publish",
    ),
    "F1": (
        "exactly-once agent, backlog, SQLite full sync, vs the strongest nats-py loop (>= 1.0x)",
        "agent",
    ),
    "F2": ("the same vs FastStream as documented, the faster of its two set-ups (>= 4x)", "agent"),
    "F3": (
        "open loop 1,000 cmd/s from the schedule: p50 and p99 vs FastStream's (<= 1.0x)",
        "latency",
    ),
    "F4": ("PostgreSQL store vs SQLite store, one worker (>= 0.9x)", "agent"),
    "F5": (
        "2 workers vs 1 on a shared PostgreSQL: plain speed-up, each process's CPU (reported)",
        "partitions",
    ),
    "F6": ("worker RSS draining commands (<= 150 MB and flat)", "rss"),
    "F7": ("store bytes per command after retention (reported; flat)", "storage"),
    "W1": ("WAL a command, the agent's store stage on SQLite (<= 3 KB)", "store"),
    "W2": ("the agent's worker CPU a command, SQLite, durability = sync (<= 70 us)", "agent"),
    "C1": ("console dead-letter list with 1,000,000 letters stored (< 1 s)", "console"),
    "T1": (
        "typed payload vs dict checked by hand: the handler step, CPU a delivery (>= 0.95x)",
        "typed",
    ),
    "T2": ("the same through a worker draining a backlog, its CPU a command (>= 0.95x)", "typed"),
    "N1": ("fleet start rate, last tenth vs second tenth (>= 0.7x)", "fleet"),
    "N2": ("every node alive in ctl nodes", "fleet"),
    "N3": ("a job to every node at an asked 200/s, by the nodes' clocks (>= 90%)", "fleet"),
    "N4": ("each node ran the job's command exactly once, counted by the nodes", "fleet"),
    "N5": ("controller CPU per node, largest fleet vs smallest (<= 1.5x)", "fleet"),
    "N6": ("ctl nodes, ctl job status, console overview/nodes/job pages (each < 1 s)", "fleet"),
    "N7": ("server RSS and JetStream API requests per node (reported)", "fleet"),
}


def run(script: Path, args: list[str]) -> tuple[int, list[dict[str, object]]]:
    """Run one script, echoing its output; its exit code and the floors it printed."""
    found: list[dict[str, object]] = []
    with subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes in every script")
    parser.add_argument(
        "--only", default="", help="comma-separated script names without bench_, e.g. publish,store"
    )
    args = parser.parse_args()
    here = Path(__file__).parent
    wanted = {f"bench_{name.strip()}.py" for name in args.only.split(",") if name.strip()}
    failed: dict[str, int] = {}
    floors: list[dict[str, object]] = []
    took: dict[str, float] = {}
    started = time.monotonic()
    for script in sorted(here.glob("bench_*.py")):
        if wanted and script.name not in wanted:
            continue
        began = time.monotonic()
        print(f"\n=== {script.name} ===", flush=True)
        rc, found = run(script, ["--quick"] if args.quick else [])
        if rc:
            failed[script.name] = rc
            for f in found:  # what it printed before it failed is not a result
                f["failed"] = rc
        floors.extend(found)
        took[script.name] = time.monotonic() - began
    print("\n=== minutes per script ===")
    print(
        "  ".join(
            f"{name.removeprefix('bench_').removesuffix('.py')} {t / 60:.1f}"
            for name, t in took.items()
        )
    )
    summary(
        floors,
        failed,
        {s.removeprefix("bench_").removesuffix(".py") for s in took},
        time.monotonic() - started,
    )
    if failed:
        print(f"\nfailed: {', '.join(f'{name} (exit {rc})' for name, rc in failed.items())}")
        return 1
    return 0


def verdict(f: dict[str, object]) -> str:
    if f.get("failed"):
        return "FAILED"
    met = f.get("met")
    return "yes" if met is True else "NO" if met is False else "n/a"


def summary(
    floors: list[dict[str, object]], failed: dict[str, int], ran: set[str], seconds: float
) -> None:
    """One row per floor printed; a floor whose script failed or did not run says so."""
    print(f"\n=== floors (all benchmarks took {seconds / 60:.1f} min) ===")
    rows = [("id", "what", "value", "floor", "met", "note")]
    for fid, (what, owner) in FLOORS.items():
        mine = [f for f in floors if f.get("id") == fid]
        rc = failed.get(f"bench_{owner}.py")
        if not mine:
            if rc:
                rows.append((fid, what, "-", "", "FAILED", f"bench_{owner}.py exited with {rc}"))
            else:
                why = "no benchmark reported it" if owner in ran else f"bench_{owner}.py not run"
                rows.append((fid, what, "-", "", "not measured", why))
        for f in mine:
            note = str(f.get("note") or "") + (
                f" (bench_{owner}.py exited with {rc})" if f.get("failed") else ""
            )
            rows.append(
                (
                    fid,
                    str(f.get("what")),
                    str(f.get("value")),
                    str(f.get("target")),
                    verdict(f),
                    note,
                )
            )
    for f in floors:
        if f.get("id") not in FLOORS:
            rows.append((str(f.get("id")), str(f.get("what")), str(f.get("value")), str(f.get("target")), verdict(f),
                         str(f.get("note") or "")))  # fmt: skip
    widths = [max(len(r[i]) for r in rows[:]) for i in range(5)]
    for r in rows:
        print(
            "  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True))
            + (f"  {r[5]}" if r[5] else "")
        )


if __name__ == "__main__":
    raise SystemExit(main())
