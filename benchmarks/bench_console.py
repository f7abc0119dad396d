"""The console's dead-letter list with a million dead letters stored: each page under a second.

Fills ``MESHFORGE_FAILED`` with N dead letters (default 1,000,000; ``--quick`` 100,000),
starts ``meshforge console`` on it, and times the pages an operator opens: the first page,
a page deep in the stream, a rare reason, the last five minutes, one letter and the
overview. The list pages by stream sequence, so its time must not grow with N.

    python benchmarks/bench_console.py [--quick] [--n 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import console, machine
from _floors import floor
from rich.table import Table

from meshforge.config import load_settings
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_FAILED
from meshforge.transport.connection import Connection, connect
from meshforge.transport.server import EmbeddedServer

TOKEN = "bench-operator-token"
BODY = b'{"id":"x","type":"bench.create","payload":{"n":' + b"0" * 80 + b"}}"
ROUNDS = 5
TARGET = 1.0


async def fill(url: str, n: int) -> None:
    """N dead letters, a rare reason every 1,000th, stored at full speed (core publish)."""
    settings = load_settings({"nats_url": url}, env={})
    conn = await connect(settings, name="bench-console-fill")
    await ensure(conn.js, default_streams(settings), [])
    started = time.perf_counter()
    for i in range(n):
        reason = "expired" if i % 1000 == 999 else "max_deliveries"
        subject = f"cmd.default.demo.bench{i % 10}.create"
        headers = {"Dlq-Reason": reason, "Dlq-Original-Subject": subject, "Dlq-Deliveries": "5",
                   "Dlq-Error": "RuntimeError: benchmark"}  # fmt: skip
        await conn.nc.publish("failed." + subject, BODY, headers=headers)
        if i % 5000 == 4999:
            await conn.nc.flush()
            await stored_at_least(conn, i - 50_000)  # let the server catch up before sending more
    await conn.nc.flush()
    stored = await stored_at_least(conn, n)
    took = time.perf_counter() - started
    console.print(f"stored {stored:,} dead letters in {took:.0f} s ({stored / took:,.0f}/s)")
    await conn.close()


async def stored_at_least(conn: Connection, count: int) -> int:
    """How many messages the dead-letter stream holds, once it holds at least ``count``."""
    while True:
        stored = int((await conn.js.stream_info(STREAM_FAILED)).state.messages)
        if stored >= count:
            return stored
        await asyncio.sleep(0.05)  # the server is still storing what was sent


def start_console(url: str, home: Path) -> tuple[subprocess.Popen[bytes], str]:
    out = home / "console.out"
    env = {
        **os.environ,
        "MESHFORGE_CONSOLE_OPERATOR_TOKEN": TOKEN,
        "MESHFORGE_LOG_LEVEL": "WARNING",
    }
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshforge", "console", "--port", "0", "--nats-url", url],
            stdout=sink, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    end = time.monotonic() + 60
    while not (found := re.search(r"console at (http://\S+)", out.read_text())):
        if proc.poll() is not None or time.monotonic() > end:
            raise SystemExit(f"the console did not start:\n{out.read_text()}")
        time.sleep(0.1)  # waiting for the console's URL line
    return proc, found.group(1).rstrip("/")


def get(url: str) -> tuple[float, int]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        size = len(response.read())
    return time.perf_counter() - started, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="100,000 dead letters")
    parser.add_argument("--n", type=int, default=None)
    args = parser.parse_args()
    n = args.n or (100_000 if args.quick else 1_000_000)
    with tempfile.TemporaryDirectory(prefix="bench-console-") as tmp:
        home = Path(tmp)
        with EmbeddedServer(store_dir=home / "nats") as server:
            asyncio.run(fill(server.url, n))
            proc, base = start_console(server.url, home)
            try:
                pages = {
                    "first page (50)": "/dead-letters",
                    "deep page (50)": f"/dead-letters?start={n - 1000}",
                    "subject filter": "/dead-letters?subject=cmd.default.demo.bench7.create",
                    "rare reason (1 in 1,000)": "/dead-letters?reason=expired",
                    "last 5 minutes": "/dead-letters?since=5",
                    "one letter": f"/dead-letters/{n // 2}",
                    "overview": "/",
                }
                results = {}
                for name, path in pages.items():
                    get(base + path)  # warm: templates compiled, connection made
                    times = [get(base + path)[0] for _ in range(ROUNDS)]
                    results[name] = (statistics.median(times), max(times))
            finally:
                proc.terminate()
                proc.wait(15)
    table = Table(title=f"console pages with {n:,} dead letters stored ({machine()})")
    table.add_column("page")
    table.add_column("median s", justify="right")
    table.add_column("max s", justify="right")
    for name, (median, worst) in results.items():
        table.add_row(name, f"{median:.3f}", f"{worst:.3f}")
    console.print(table)
    listing = max(results[k][0] for k in ("first page (50)", "deep page (50)", "subject filter"))
    floor(
        "C1",
        f"console dead-letter list, {n:,} letters stored (slowest of first/deep/subject page, median)",
        f"{listing:.3f} s",
        f"< {TARGET:g} s",
        met=listing < TARGET,
        note=f"rare reason {results['rare reason (1 in 1,000)'][0]:.2f} s, overview {results['overview'][0]:.2f} s",
    )
    return 0 if listing < TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
