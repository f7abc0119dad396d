"""Run every benchmark script in this folder, one after the other, and print their figures.

Each ``bench_*.py`` starts its own embedded nats-server, measures MeshForge against a
baseline in the same run (raw nats-py, and the competitor named by the issue) and prints
the ratios. Pass ``--quick`` for smaller sizes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    here = Path(__file__).parent
    args = sys.argv[1:]
    failed = []
    for script in sorted(here.glob("bench_*.py")):
        print(f"\n=== {script.name} ===", flush=True)
        rc = subprocess.call([sys.executable, str(script), *args])
        if rc != 0:
            failed.append(script.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
