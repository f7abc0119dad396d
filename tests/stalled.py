"""Run pytest with every test worker stopped for a moment, again and again (``make test-stalled``).

A loaded CI machine (a CPU quota, a noisy neighbour) pauses a process for a tenth of a
second now and then; a test whose margin is smaller than that fails there and nowhere
else. This runs the suite while each xdist worker is stopped (SIGSTOP) for ``--stall``
seconds every ``--every`` seconds, so such a test fails here first.

Only the workers are stopped, never their children: a test that stops a child of its own
keeps it stopped. Usage: ``python tests/stalled.py [--stall 0.15] [--every 2] -- PYTEST ARGS``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (pytest's xdist workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # The command name, in parentheses, may hold spaces: the fields follow its last ")".
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, signum)


def stall(pid: int, done: threading.Event, *, every: float, length: float) -> int:
    """Stop the children of ``pid`` for ``length`` seconds every ``every`` seconds."""
    rounds = 0
    while not done.wait(every - length):
        workers = children(pid)
        _signal_all(workers, signal.SIGSTOP)
        done.wait(length)
        _signal_all(workers, signal.SIGCONT)  # always, even when the run just ended
        rounds += 1
    return rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stall", type=float, default=0.15, help="seconds each stop lasts")
    parser.add_argument("--every", type=float, default=2.0, help="seconds from stop to stop")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if not 0 < args.stall < args.every:
        parser.error("--stall must be positive and shorter than --every")
    pytest_args = [a for a in args.pytest_args if a != "--"]
    run = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args])
    done = threading.Event()
    rounds: list[int] = []
    stopper = threading.Thread(
        target=lambda: rounds.append(stall(run.pid, done, every=args.every, length=args.stall)),
        daemon=True,
    )
    stopper.start()
    try:
        code = run.wait()
    except KeyboardInterrupt:
        run.send_signal(signal.SIGINT)
        code = run.wait()
    done.set()
    stopper.join()
    print(f"stalled.py: workers stopped {rounds[0]} times, {args.stall}s every {args.every}s")
    return code


if __name__ == "__main__":
    sys.exit(main())
