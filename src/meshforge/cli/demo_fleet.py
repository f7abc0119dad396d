"""``meshforge demo --fleet``: two sites on leaf nodes, twenty nodes, a rollout through a
cut link, and a cancel, on servers of its own on loopback.

The hub and the two site servers run as nats-server children; the nodes run in this
process (``NodeRuntime`` with the demo node), each site's on a connection to its own
server, and the job controller on the hub's. Site B's leaf link goes through a relay the
demo cuts and restores. At the end it checks, from the nodes' own counters, that every
node ran the rollout's command exactly once and that no canceled command ran: exit 1 if not.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from meshforge.config import Settings, load_settings
from meshforge.control.fleet import list_nodes
from meshforge.control.jobs import JobSpec, JobStore
from meshforge.control.rollout import JobController, summarize
from meshforge.control.runtime import NodeRuntime
from meshforge.control.sites import hub_leaf_port, hub_server, link_site, site_server
from meshforge.demo.node import DemoNode
from meshforge.ops.observability import Metrics
from meshforge.store import open_store
from meshforge.testing.link import LinkRelay
from meshforge.topology.subjects import STREAM_CONTROL
from meshforge.transport.connection import Connection, connect
from meshforge.transport.server import EmbeddedServer

__all__ = ["run_fleet_demo"]

SITES = ("plantA", "plantB")


async def _until(check: Callable[[], Any], timeout: float, what: str) -> None:  # noqa: ASYNC109
    """Poll ``check`` (sync or async) until true, or fail naming ``what``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > end:
            raise TimeoutError(f"the fleet demo timed out waiting for {what}")
        await asyncio.sleep(0.1)  # polling with a deadline


class _Fleet:
    """The servers, the nodes and their connections: started and stopped as one."""

    def __init__(self, work: Path, per_site: int) -> None:
        self.work = work
        self.per_site = per_site
        self.settings: Settings = load_settings()
        self.metrics = Metrics()
        self.leaf_port = 0  # the hub binds a free one; read back once it runs
        self.hub = hub_server(work / "hub", leaf_port=0)
        self.links: dict[str, LinkRelay] = {}
        self.servers: dict[str, EmbeddedServer] = {}
        self.conns: list[Connection] = []
        self.runtimes: list[tuple[NodeRuntime, asyncio.Task[None]]] = []
        self.store = open_store(f"sqlite:///{work / 'nodes.db'}")

    @contextlib.asynccontextmanager
    async def up(self, console: Console) -> AsyncIterator[Connection]:
        try:
            await asyncio.to_thread(self.hub.start)
            self.leaf_port = await asyncio.to_thread(hub_leaf_port, self.hub)
            console.print(f"hub (domain hub) at {self.hub.url}")
            for site in SITES:
                await self._site(site, console)
            hub = await connect(self.settings, url=self.hub.url, name="fleet-demo-hub")
            self.conns.append(hub)
            yield hub
        finally:
            for runtime, task in self.runtimes:
                await runtime.stop(5)
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(task, 10)
            for conn in self.conns:
                with contextlib.suppress(Exception):
                    await conn.close()
            for link in self.links.values():
                await link.cut()
            for server in [*self.servers.values(), self.hub]:
                await asyncio.to_thread(server.close)
            self.store.close()

    async def _site(self, site: str, console: Console) -> None:
        link = await LinkRelay(self.leaf_port).start()
        server = site_server(site, link.url, store_dir=self.work / site)
        await asyncio.to_thread(server.start)
        self.links[site], self.servers[site] = link, server

        async def linked() -> bool:
            try:
                await link_site(server.url, site, settings=self.settings, timeout=1.0)
            except Exception:  # the leaf link is still coming up
                return False
            return True

        await _until(linked, 30, f"site {site} to link to the hub")
        conn = await connect(self.settings, url=server.url, name=f"fleet-demo-{site}")
        self.conns.append(conn)
        for i in range(self.per_site):
            runtime = NodeRuntime(
                DemoNode(), site, f"valve{i:02d}", conn, self.store, settings=self.settings,
                presence_interval=1.0, metrics=self.metrics, probe_interval=3600.0,
            )  # fmt: skip
            self.runtimes.append((runtime, asyncio.create_task(runtime.run())))
        console.print(
            f"site {site} (domain {site}, leaf node of the hub) at {server.url}: {self.per_site} nodes"
        )

    def runs(self, command: str) -> dict[str, float]:
        """How many times each node ran ``command``, from the nodes' own counters."""
        out = {}
        for metric in self.metrics.node_commands.collect():
            for sample in metric.samples:
                labels = sample.labels
                if sample.name.endswith("_total") and labels.get("command") == command:
                    out[f"{labels['site']}.{labels['node']}"] = sample.value
        return out


def _counts(console: Console, title: str, records: dict[str, Any]) -> None:
    table = Table(title=title)
    table.add_column("site")
    states = [s for s, n in summarize(records).items() if n]
    for state in states:
        table.add_column(state, justify="right")
    for site in SITES:
        mine = {k: r for k, r in records.items() if k.startswith(f"{site}.")}
        counts = summarize(mine)
        table.add_row(site, *(str(counts[s]) for s in states))
    console.print(table)


async def _rollout(
    console: Console,
    fleet: _Fleet,
    hub: Connection,
    store: JobStore,
    targets: list[tuple[str, str]],
) -> bool:
    job = "firmware-7"
    console.rule(
        f"[bold]1. job {job}: echo to {len(targets)} nodes at 600/min; plantB's link is cut mid-way"
    )
    await store.create(JobSpec(job, "echo", {"firmware": "7.1"}, targets=targets, rate=600))
    controller = asyncio.create_task(JobController(hub, store, job).run())

    first = max(2, len(targets) * 3 // 10)  # the cut falls after about a third

    async def some_sent() -> bool:
        return summarize(await store.nodes(job))["QUEUED"] <= len(targets) - first

    await _until(some_sent, 30, "the first commands to go out")
    await fleet.links["plantB"].cut()
    console.print(
        "[yellow]plantB's leaf link is cut[/]: its nodes run what the site holds; the rest waits on the hub"
    )
    await asyncio.sleep(3)  # the demo lets the cut last a moment, to show it
    _counts(console, "during the cut (as the hub sees it)", await store.nodes(job))
    ran_b = sum(v for k, v in fleet.runs("echo").items() if k.startswith("plantB."))
    held = await _stored(hub, "control.cmd.plantB.>")
    console.print(
        f"at plantB meanwhile: {ran_b:g} ran, their replies wait at the site; the hub still holds "
        f"{held} of plantB's commands (sent during the cut, or not yet acknowledged by the site)"
    )
    await fleet.links["plantB"].restore()
    console.print(
        "[green]plantB's link is back[/]: held commands flow to the site, replies to the hub"
    )
    final = await asyncio.wait_for(controller, 60)
    records = await store.nodes(job)
    _counts(console, f"job {job}: {final}", records)
    ran = fleet.runs("echo")
    twice = {k: v for k, v in ran.items() if v != 1}
    ok = (
        final == "completed"
        and summarize(records)["SUCCEEDED"] == len(targets)
        and len(ran) == len(targets)
        and not twice
    )
    console.print(f"every node ran it once: {'[green]yes' if ok else '[red]NO ' + str(twice)}[/]")
    return ok


async def _cancel(
    console: Console,
    fleet: _Fleet,
    hub: Connection,
    store: JobStore,
    targets: list[tuple[str, str]],
) -> bool:
    job = "maintenance-window"
    console.rule(
        f"[bold]2. job {job}: sleep 0.5 s on {len(targets)} nodes at 120/min, canceled after 4"
    )
    await store.create(JobSpec(job, "sleep", {"seconds": 0.5}, targets=targets, rate=120))
    controller = asyncio.create_task(JobController(hub, store, job).run())

    async def four_sent() -> bool:
        counts = summarize(await store.nodes(job))
        return counts["QUEUED"] <= len(targets) - 4

    await _until(four_sent, 30, "four commands to go out")
    await store.cancel(job)
    console.print("meshforge ctl job cancel maintenance-window")
    final = await asyncio.wait_for(controller, 60)
    records = await store.nodes(job)
    _counts(console, f"job {job}: {final}", records)
    ran = sum(fleet.runs("sleep").values())
    done = summarize(records)["SUCCEEDED"]
    ok = (
        final == "canceled"
        and ran == done
        and summarize(records)["CANCELED"] == len(targets) - done
    )
    console.print(
        f"no canceled command ran ({ran} ran, {done} succeeded): {'[green]yes' if ok else '[red]NO'}[/]"
    )
    return ok


async def _story(console: Console, work: Path, per_site: int) -> bool:
    fleet = _Fleet(work, per_site)
    async with fleet.up(console) as hub:
        total = per_site * len(SITES)
        await _until(
            lambda: _seen(hub, total), 60, f"all {total} nodes to announce themselves at the hub"
        )
        rows = await list_nodes(hub.js)
        console.print(
            f"meshforge ctl nodes: {len(rows)} nodes, {sum(r.liveness == 'alive' for r in rows)} alive"
        )
        store = await JobStore.open(hub.js)
        # Interleaved, so the cut falls in the middle of plantB's share.
        targets = [(site, f"valve{i:02d}") for i in range(per_site) for site in SITES]
        ok = await _rollout(console, fleet, hub, store, targets)
        return await _cancel(console, fleet, hub, store, targets) and ok


async def _stored(hub: Connection, subject: str) -> int:
    info = await hub.js.stream_info(STREAM_CONTROL, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def _seen(hub: Connection, total: int) -> bool:
    return len(await list_nodes(hub.js)) >= total


def run_fleet_demo(home: Path, per_site: int = 10) -> bool:
    """Run the fleet story under ``home/demo-fleet`` (fresh each run); True when it held."""
    console = Console()
    work = home / "demo-fleet"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_story(console, work, per_site))
