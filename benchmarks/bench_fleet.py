"""A fleet of simulated nodes on one nats-server: start, presence, a job to all, the reads.

For each size (default 1,000, 3,000 and 10,000 nodes; ``--sizes`` to pick, ``--quick``
1,000 only) a fresh embedded server (HTTP monitoring on) and ``--procs`` processes of real
``NodeRuntime``s (``_fleet_nodes.py``: many nodes on one connection, presence every 10 s).
It measures and prints, each with its floor (issue 36) and whether it is met:

- N1 the start rate by tenth of the fleet: the last tenth at least 0.7x the second; N1b the
  same for the fleet started again, its mailboxes existing (nats-server creates no consumer);
- N2 the time until ``meshforge ctl nodes`` lists every node alive;
- N3 a job to every node at an asked 200 commands/s (its controller run in this process):
  the rate the nodes ran it at, at least 90% of the asked one;
- N4 each node ran its command exactly once, counted by the nodes (their run logs);
- N5 the controller's CPU per node, flat from the smallest size to the largest (<= 1.5x);
- N6 what ``ctl nodes`` and ``ctl job status`` read (from connecting to the last row) and
  the console's overview, nodes and job pages: each under 1 s (median of 3); each
  command's whole time, interpreter start included, is printed beside;
- N7 (reported) the server's RSS and JetStream API requests per node: at start, and per
  second while the fleet is idle (its announcements and probes only); and what a site
  adds to its hub (``--sites`` site servers linked as ``meshforge server --leaf`` does).

The control stream is provisioned as ``meshforge provision`` does: no consumer limit
(``control_max_consumers``), one consumer per node.

    python benchmarks/bench_fleet.py [--quick] [--sizes 1000,3000] [--procs 4] [--rate 200] [--sites 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import console, machine
from _floors import floor
from bench_console import get, start_console
from rich.table import Table

from meshforge.config import load_settings
from meshforge.control.jobs import JobSpec, JobStore, attempt_id
from meshforge.control.rollout import JobController
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer

HERE = Path(__file__).parent
SITE = "bench"
READ_LIMIT = 1.0  # seconds, each read (issue 36, point 5)
START_RATIO = 0.7  # last tenth / second tenth of the start rate (point 2)
RATE_SHARE = 0.9  # of the asked rate (point 3, "Done when")
CPU_FLAT = 1.5  # largest size's controller CPU per node / the smallest's (point 3)
IDLE_WINDOW = 60.0  # seconds of an idle fleet measured: a node probe's interval, 2.4 long polls
ROUNDS = 3


@dataclass
class Result:
    """What one size measured."""

    size: int
    start_rates: list[float] = field(default_factory=list)  # nodes/s per tenth
    restart_rates: list[float] = field(default_factory=list)  # the same, mailboxes existing
    restart_after: float = 0.0
    alive_after: float = 0.0
    start_requests: float = 0.0  # JetStream API requests per node during the start
    idle_requests: float = 0.0  # per node per second, idle
    idle_msgs: float = 0.0  # messages into the server per node per second, idle
    idle_cpu: float = 0.0  # server CPU seconds per second, idle
    rss: float = 0.0  # server RSS per node, bytes
    rss_total: float = 0.0
    rollout_rate: float = 0.0  # by the nodes' clocks
    sent_rate: float = 0.0  # by the controller's records
    middle_rate: float = 0.0  # by the nodes' clocks, the middle 90% of the runs
    job_wall: float = 0.0
    job_status: str = ""
    ran_once: bool = False
    ran_note: str = ""
    cpu_per_node: float = 0.0  # controller CPU seconds per node
    reads: dict[str, float] = field(default_factory=dict)
    commands: dict[str, float] = field(
        default_factory=dict
    )  # whole commands, interpreter start included
    command_alive: int = 0  # nodes the ctl nodes command itself listed alive
    warnings: int = 0


def monitor(server: EmbeddedServer, path: str) -> dict[str, Any]:
    url = f"http://{server.host}:{server.monitor_port}/{path}"
    with urllib.request.urlopen(url, timeout=30) as response:
        loaded: dict[str, Any] = json.loads(response.read())
    return loaded


def cpu_seconds(server: EmbeddedServer) -> float:
    """The server process's CPU seconds so far (user + system, from /proc)."""
    fields = Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def api_requests(server: EmbeddedServer) -> int:
    return int(monitor(server, "jsz")["api"]["total"])


def meshforge(*args: str, url: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    """A ``meshforge`` command to its end: its wall time and result."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "meshforge", *args, "--nats-url", url],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    return time.perf_counter() - started, done


async def listed(url: str) -> tuple[float, list[dict[str, Any]]]:
    """What ``ctl nodes --json`` reads, timed from connecting to having every row."""
    from meshforge.control import fleet

    started = time.perf_counter()
    conn = await connect(load_settings({"nats_url": url}, env={}), name="bench-fleet-read")
    if hasattr(fleet, "survey"):  # one listing and a request or two for the whole fleet
        rows = (await fleet.survey(conn.js, None)).to_dict()["nodes"]
    else:  # requests per node
        rows = [row.to_dict() for row in await fleet.list_nodes(conn.js, None)]
    took = time.perf_counter() - started
    await conn.close()
    return took, rows


def alive(url: str) -> tuple[float, int]:
    """The time of one listing and how many nodes it shows alive."""
    took, rows = asyncio.run(listed(url))
    return took, sum(1 for r in rows if r.get("liveness") == "alive")


async def job_status(url: str, job: str) -> float:
    """What ``ctl job status --json`` reads, timed from connecting to the report."""
    from meshforge.control.rollout import job_report

    started = time.perf_counter()
    conn = await connect(load_settings({"nats_url": url}, env={}), name="bench-fleet-read")
    await job_report(await JobStore.open(conn.js, create=False), job)
    took = time.perf_counter() - started
    await conn.close()
    return took


async def drive(url: str, job: str) -> tuple[str, float, float, float]:
    """The job's controller, run here: its final status, wall and CPU seconds, and the rate
    it sent at (by its own records)."""
    settings = load_settings({"nats_url": url}, env={})
    conn = await connect(settings, name="bench-fleet-controller")
    store = await JobStore.open(conn.js)
    wall, cpu = time.perf_counter(), time.process_time()
    final = await JobController(conn, store, job).run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    sent = sorted(
        datetime.fromisoformat(str(r.sent_at))
        for r in (await store.nodes(job)).values()
        if r.sent_at
    )
    rate = (
        (len(sent) - 1) / max((sent[-1] - sent[0]).total_seconds(), 1e-6) if len(sent) > 1 else 0.0
    )
    await conn.close()
    return final, wall, cpu, rate


async def provision(url: str) -> None:
    """The five streams; the control stream takes a consumer per node with no limit (the
    setting ``control_max_consumers``, unlimited by default)."""
    settings = load_settings({"nats_url": url}, env={})
    conn = await connect(settings, name="bench-fleet-provision")
    await ensure(conn.js, default_streams(settings), [])
    await conn.close()


async def create_job(url: str, job: str, size: int, rate: float) -> None:
    settings = load_settings({"nats_url": url}, env={})
    conn = await connect(settings, name="bench-fleet-job")
    store = await JobStore.open(conn.js)
    targets = [(SITE, f"n{i}") for i in range(size)]
    await store.create(JobSpec(job, "echo", {}, targets=targets, rate=rate * 60))
    await conn.close()


def lines(out: Path, prefix: str) -> list[tuple[str, float]]:
    found = []
    for path in sorted(out.glob(f"{prefix}-*.txt")):
        for line in path.read_text().splitlines():
            name, at = line.split()
            found.append((name, float(at)))
    return found


def tenths(times: list[float], began: float) -> list[float]:
    """Nodes per second in each tenth of the start (by when each node was ready)."""
    times = sorted(times)
    n = len(times)
    edges = [began] + [times[min(n - 1, (n * k) // 10 - 1)] for k in range(1, 11)]
    return [(n // 10) / max(edges[k + 1] - edges[k], 1e-6) for k in range(10)]


def launch(url: str, size: int, procs: int, out: Path) -> list[subprocess.Popen[bytes]]:
    """``procs`` processes of ``_fleet_nodes.py`` sharing the ``size`` nodes."""
    workers = []
    share = -(-size // procs)
    for first in range(0, size, share):
        count = min(share, size - first)
        args = [sys.executable, str(HERE / "_fleet_nodes.py"), url, SITE, str(first), str(count)]
        with (out / f"nodes-{first}.log").open("ab") as log:
            workers.append(
                subprocess.Popen([*args, str(out)], stdout=log, stderr=subprocess.STDOUT)
            )
    return workers


def stop(workers: list[subprocess.Popen[bytes]]) -> None:
    for worker in workers:
        worker.terminate()
    for worker in workers:
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def wait_for_all(
    workers: list[subprocess.Popen[bytes]], size: int, count: Callable[[], int], what: str,
    began: float, every: float = 1.0,
) -> None:  # fmt: skip
    """Until ``count()`` reaches ``size``; fails if a node process exits or time runs out."""
    deadline = time.monotonic() + max(900.0, size * 0.3)
    while (seen := count()) < size:
        dead = [w.returncode for w in workers if w.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(
                f"{seen:,} of {size:,} nodes {what} after {time.time() - began:.0f} s"
                f" (node processes exited: {dead})"
            )
        time.sleep(every)  # polling with a deadline


def measure(size: int, procs: int, rate: float, home: Path) -> Result:
    result = Result(size)
    out = home / "out"
    out.mkdir()
    with EmbeddedServer(store_dir=home / "nats") as server:
        url = server.url
        asyncio.run(provision(url))
        before = api_requests(server)
        began = time.time()
        workers = launch(url, size, procs, out)
        try:
            wait_for_all(workers, size, lambda: alive(url)[1], "alive", began, every=2.0)
            result.alive_after = time.time() - began
            ready = [at for _, at in lines(out, "ready")]
            result.start_rates = tenths(ready, began)
            result.start_requests = (api_requests(server) - before) / size
            console.print(
                f"{size:,} nodes: all alive in ctl nodes after {result.alive_after:.1f} s"
            )

            # Idle: announcements and probes only.
            api0, msgs0 = api_requests(server), int(monitor(server, "varz")["in_msgs"])
            cpu0 = cpu_seconds(server)
            time.sleep(IDLE_WINDOW)  # the window measured
            api1, varz = api_requests(server), monitor(server, "varz")
            result.idle_cpu = (cpu_seconds(server) - cpu0) / IDLE_WINDOW
            result.idle_requests = (api1 - api0) / IDLE_WINDOW / size
            result.idle_msgs = (int(varz["in_msgs"]) - msgs0) / IDLE_WINDOW / size
            result.rss_total = float(varz["mem"])
            result.rss = result.rss_total / size
            result.reads["ctl nodes (read)"] = statistics.median(
                alive(url)[0] for _ in range(ROUNDS)
            )
            took, done = meshforge("ctl", "nodes", "--json", url=url)
            rows = json.loads(done.stdout) if done.returncode == 0 else []
            rows = rows["nodes"] if isinstance(rows, dict) else rows
            result.command_alive = sum(1 for r in rows if r.get("liveness") == "alive")
            result.commands["ctl nodes --json"] = took

            job = f"bench{uuid.uuid4().hex[:6]}"
            asyncio.run(create_job(url, job, size, rate))
            result.job_status, result.job_wall, cpu, result.sent_rate = asyncio.run(drive(url, job))
            result.cpu_per_node = cpu / size
            runs = lines(out, "runs")
            counted = Counter(command_id for command_id, _ in runs)
            expected = {attempt_id(job, SITE, f"n{i}", 1) for i in range(size)}
            twice = sum(1 for n in counted.values() if n > 1)
            result.ran_once = set(counted) == expected and twice == 0
            result.ran_note = (
                f"{len(set(counted) & expected):,} of {size:,} ran, {twice} more than once"
            )
            at = sorted(t for _, t in runs)
            if len(at) > 1:
                result.rollout_rate = (len(at) - 1) / max(at[-1] - at[0], 1e-6)
            if len(at) >= 20:  # the steady part: a few late nodes aside
                low, high = len(at) // 20, len(at) - 1 - len(at) // 20
                result.middle_rate = (high - low) / max(at[high] - at[low], 1e-6)

            took_each = [asyncio.run(job_status(url, job)) for _ in range(ROUNDS)]
            result.reads["ctl job status (read)"] = statistics.median(took_each)
            result.commands["ctl job status --json"] = meshforge(
                "ctl", "job", "status", job, "--json", url=url
            )[0]
            proc, base = start_console(url, home)
            try:
                for name, path in (("console /", "/"), ("console /nodes", "/nodes"),
                                   ("console /jobs/JOB", f"/jobs/{job}")):  # fmt: skip
                    get(base + path)  # warm: templates compiled, connection made
                    result.reads[name] = statistics.median(
                        get(base + path)[0] for _ in range(ROUNDS)
                    )
            finally:
                proc.terminate()
                proc.wait(30)
            # The same fleet started again: every mailbox exists, so nats-server creates no
            # consumer (on a work-queue stream, a create checks the new filter against every
            # other consumer's, and so the first start gets slower as the fleet grows).
            stop(workers)
            for done_file in out.glob("ready-*.txt"):
                done_file.rename(done_file.with_name(f"first-{done_file.name}"))
            began = time.time()
            workers = launch(url, size, procs, out)
            wait_for_all(workers, size, lambda: len(lines(out, "ready")), "restarted", began)
            ready = [at for _, at in lines(out, "ready")]
            result.restart_rates = tenths(ready, began)
            result.restart_after = max(ready) - began
        finally:
            stop(workers)
        said = [
            re.sub(r"\d+", "N", line)[:140]
            for path in out.glob("nodes-*.log")
            for line in path.read_text(errors="replace").splitlines()
            if "WARNING" in line
        ]
        result.warnings = len(said)
        for line, count in Counter(said).most_common(3):
            console.print(f"  node warning x{count:,}: {line}")
    return result


def hub_idle(hub: EmbeddedServer) -> tuple[float, float, float, float]:
    """The hub over an idle window: RSS bytes, API requests/s, messages in/s, CPU s/s."""
    api0, msgs0 = api_requests(hub), int(monitor(hub, "varz")["in_msgs"])
    cpu0 = cpu_seconds(hub)
    time.sleep(IDLE_WINDOW)  # the window measured
    varz = monitor(hub, "varz")
    return (
        float(varz["mem"]),
        (api_requests(hub) - api0) / IDLE_WINDOW,
        (int(varz["in_msgs"]) - msgs0) / IDLE_WINDOW,
        (cpu_seconds(hub) - cpu0) / IDLE_WINDOW,
    )


def measure_sites(count: int, home: Path) -> None:
    """What a site adds to its hub: ``count`` site servers linked as ``meshforge server
    --leaf`` links them (four sources), no nodes; the hub idle before and after."""
    from meshforge.control.sites import hub_leaf_port, hub_server, link_site, site_server

    sites: list[EmbeddedServer] = []
    with hub_server(home / "hub", leaf_port=0) as hub:
        settings = load_settings({"nats_url": hub.url}, env={})
        asyncio.run(provision(hub.url))
        before = hub_idle(hub)
        leaf = f"nats-leaf://127.0.0.1:{hub_leaf_port(hub)}"
        try:
            for i in range(count):
                site = site_server(f"site{i}", leaf, store_dir=home / f"site{i}")
                sites.append(site.start())
                deadline = time.monotonic() + 60
                while True:
                    try:
                        asyncio.run(link_site(site.url, f"site{i}", settings=settings, timeout=2))
                        break
                    except Exception:  # the leaf link is still coming up
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)  # polling the link with a deadline
            after = hub_idle(hub)
        finally:
            for site in sites:
                site.close()
    added = [(a - b) / count for a, b in zip(after, before, strict=True)]
    table = Table(
        title=f"what a site adds to the hub: {count} sites linked, no nodes ({machine()})"
    )
    table.add_column("hub figure")
    table.add_column("before", justify="right")
    table.add_column(f"{count} sites", justify="right")
    table.add_column("per site", justify="right")
    names = ("RSS", "API requests/s idle", "messages in/s idle", "CPU, % of a core")
    scale = (2**-20, 1.0, 1.0, 100.0)
    units = (" MiB", "", "", "%")
    for name, b, a, d, k, u in zip(names, before, after, added, scale, units, strict=True):
        table.add_row(name, f"{b * k:,.2f}{u}", f"{a * k:,.2f}{u}", f"{d * k:,.3f}{u}")
    console.print(table)
    floor("N7", f"what a site adds to its hub ({count} linked, no nodes): RSS, API requests/s idle",
          f"{added[0] / 1024:.0f} KiB, {added[1]:.3f}", "reported", met=None,
          note=f"messages in/s {added[2]:.3f}, CPU {added[3] * 100:.2f}% of a core")  # fmt: skip


def show(r: Result, rate: float) -> None:
    table = Table(title=f"{r.size:,} simulated nodes on one nats-server ({machine()})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rates = ", ".join(f"{x:.0f}" for x in r.start_rates)
    table.add_row("start rate by tenth, nodes/s", rates)
    table.add_row("all alive in ctl nodes after", f"{r.alive_after:.1f} s")
    restarted = ", ".join(f"{x:.0f}" for x in r.restart_rates)
    table.add_row("restarted, mailboxes existing: rate by tenth, nodes/s", restarted)
    table.add_row("  all pulling again after", f"{r.restart_after:.1f} s")
    table.add_row("JetStream API requests per node start", f"{r.start_requests:.1f}")
    table.add_row("idle: API requests per node per s", f"{r.idle_requests:.3f}")
    table.add_row("idle: messages in per node per s", f"{r.idle_msgs:.3f}")
    table.add_row("idle: server CPU", f"{r.idle_cpu * 100:.1f}% of a core")
    table.add_row("server RSS", f"{r.rss_total / 2**20:,.0f} MiB ({r.rss / 1024:.0f} KiB a node)")
    table.add_row(f"job at {rate:g}/s: {r.job_status}", f"{r.job_wall:.1f} s wall")
    table.add_row("rollout rate, by the nodes' clocks", f"{r.rollout_rate:.1f}/s")
    table.add_row("  the middle 90% of the runs", f"{r.middle_rate:.1f}/s")
    table.add_row("send rate, by the controller's records", f"{r.sent_rate:.1f}/s")
    table.add_row("ran exactly once (the nodes' count)", r.ran_note)
    table.add_row("controller CPU per node", f"{r.cpu_per_node * 1000:.2f} ms")
    for name, took in r.reads.items():
        table.add_row(name, f"{took:.3f} s")
    for name, took in r.commands.items():
        table.add_row(f"the command {name} (interpreter start included)", f"{took:.3f} s")
    table.add_row("alive in the ctl nodes command's own listing", f"{r.command_alive:,}")
    table.add_row("node warnings logged", f"{r.warnings:,}")
    console.print(table)


def report(r: Result, rate: float) -> None:
    n = f"{r.size:,} nodes"
    second, last = r.start_rates[1], r.start_rates[-1]
    floor("N1", f"start rate, last tenth / second tenth, {n}", f"{last / second:.2f}x "
          f"({second:.0f} -> {last:.0f} nodes/s)", f">= {START_RATIO}x",
          met=last >= START_RATIO * second,
          note="the first start: nats-server creates each node's mailbox consumer")  # fmt: skip
    second, last = r.restart_rates[1], r.restart_rates[-1]
    floor("N1b", f"start rate of the fleet restarted (mailboxes exist), last / second tenth, {n}",
          f"{last / second:.2f}x ({second:.0f} -> {last:.0f} nodes/s)", f">= {START_RATIO}x",
          met=last >= START_RATIO * second, note=f"all pulling after {r.restart_after:.0f} s")  # fmt: skip
    floor("N2", f"all alive in ctl nodes, {n}", f"{r.alive_after:.0f} s", "all listed alive",
          met=r.command_alive == r.size, note=f"the command listed {r.command_alive:,} alive")  # fmt: skip
    floor("N3", f"rollout rate by the nodes, asked {rate:g}/s, {n}", f"{r.rollout_rate:.0f}/s",
          f">= {RATE_SHARE * rate:.0f}/s", met=r.rollout_rate >= RATE_SHARE * rate,
          note=f"middle 90% of the runs {r.middle_rate:.0f}/s; sent at {r.sent_rate:.0f}/s by the controller's records; {r.job_status} in {r.job_wall:.1f} s")  # fmt: skip
    floor("N4", f"each node ran the job's command once (nodes' count), {n}", r.ran_note,
          "all, once", met=r.ran_once)  # fmt: skip
    slowest = max(r.reads, key=lambda k: r.reads[k])
    floor("N6", f"slowest read ({slowest}), {n}", f"{r.reads[slowest]:.2f} s",
          f"< {READ_LIMIT:g} s", met=r.reads[slowest] < READ_LIMIT,
          note=", ".join(f"{k} {v:.2f}" for k, v in {**r.reads, **r.commands}.items()))  # fmt: skip
    floor("N7", f"server per node, {n}: RSS, API requests at start, API requests/s idle",
          f"{r.rss / 1024:.0f} KiB, {r.start_requests:.1f}, {r.idle_requests:.3f}",
          "reported", met=None, note=f"messages in/s idle per node {r.idle_msgs:.3f}, server CPU idle {r.idle_cpu * 100:.1f}% of a core")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1,000 nodes only")
    parser.add_argument("--sizes", default=None, help="comma-separated, e.g. 1000,3000")
    parser.add_argument("--procs", type=int, default=4, help="node processes")
    parser.add_argument("--rate", type=float, default=200.0, help="the job's commands per second")
    parser.add_argument(
        "--sites", type=int, default=10, help="sites linked to measure a site's cost"
    )
    args = parser.parse_args()
    # A stopped benchmark still stops its node processes and server (the finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [
        int(s) for s in (args.sizes or ("1000" if args.quick else "1000,3000,10000")).split(",")
    ]
    if args.sites:
        with tempfile.TemporaryDirectory(prefix="bench-fleet-sites-") as tmp:
            measure_sites(args.sites, Path(tmp))
    results = []
    failed = []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
            try:
                result = measure(size, args.procs, args.rate, Path(tmp))
            except Exception as exc:  # the next size still runs; the exit status says so
                console.print(f"{size:,} nodes: FAILED: {type(exc).__name__}: {exc}")
                failed.append(size)
                continue
        show(result, args.rate)
        report(result, args.rate)
        results.append(result)
    if len(results) > 1:
        low, high = results[0], results[-1]
        ratio = high.cpu_per_node / max(low.cpu_per_node, 1e-9)
        floor("N5", f"controller CPU per node, {high.size:,} vs {low.size:,} nodes",
              f"{ratio:.2f}x ({low.cpu_per_node * 1000:.2f} -> {high.cpu_per_node * 1000:.2f} ms)",
              f"<= {CPU_FLAT}x", met=ratio <= CPU_FLAT)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
