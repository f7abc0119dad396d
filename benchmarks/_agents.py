"""Set-up shared by the agent benchmarks: a fresh server, the command and output streams of
one variant, its process, and a tap that times every output as it arrives.

Variants: ``mf`` (``meshforge run _variants:EchoAgent``, SQLite store; ``mf-uvloop`` the
same on uvloop's event loop; ``mf-os`` the same with ``durability = os``; ``mf-checked``
and ``mf-typed`` the agent checking its payload by hand or by its declared type), ``pg``
(the same on a PostgreSQL store: a database made for the run on ``PG_ADMIN``, dropped after), ``raw`` and ``raw-serial`` (plain nats-py loops)
and ``fs``, ``fs-workers`` (FastStream), each one OS process; see ``_variants.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from meshforge.cli.demo_support import meshforge_command
from meshforge.config import load_settings
from meshforge.topology.provision import ensure
from meshforge.topology.specs import agent_consumer, default_streams
from meshforge.topology.subjects import STREAM_EVENTS
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _variants import DURABLE, FS_WORKERS, LANES, STREAM_IN, STREAM_OUT  # noqa: E402

PG_ADMIN = os.environ.get("MESHFORGE_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
LABELS = {
    "mf": "MeshForge agent (exactly once, SQLite)",
    "mf-checked": "MeshForge agent, dict payload checked by hand",
    "mf-typed": "MeshForge agent, payload declared as a Struct",
    "mf-uvloop": "MeshForge agent (SQLite) on uvloop",
    "mf-os": "MeshForge agent (SQLite), durability = os",
    "pg": "MeshForge agent (exactly once, PostgreSQL)",
    "raw": f"nats-py, {LANES} pull lanes (fetch 256, publish_async, ack)",
    "raw-serial": "nats-py serial loop (fetch, publish, wait, ack)",
    "fs": "FastStream per-message handler, PullSub(256) + publisher",
    "fs-workers": f"the same with max_workers={FS_WORKERS}",
}
# The baselines a floor compares with: the faster of each family in the same run.
BARE_LOOPS, FASTSTREAMS = ("raw", "raw-serial"), ("fs", "fs-workers")
OUR = {"mf", "pg", "mf-uvloop", "mf-os", "mf-checked", "mf-typed"}
# The agent class each of ours runs (in _variants.py).
AGENT_OF = {"mf-checked": "CheckedEchoAgent", "mf-typed": "TypedEchoAgent"}
OUTPUT_STREAMS = {k: STREAM_EVENTS if k in OUR else STREAM_OUT for k in LABELS}
SUBJECTS = {
    k: ("cmd.default.bench.echo.work", "evt.default.bench.echo.worked")
    if k in OUR
    else ("bench.in", "bench.out")
    for k in LABELS
}


@dataclass
class Tap:
    """Every output's arrival time (monotonic) and the send stamp it carries."""

    arrivals: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)
    wanted: int = 0
    full: asyncio.Event = field(default_factory=asyncio.Event)

    async def on(self, msg: Msg) -> None:
        self.take(msg)

    def take(self, msg: Msg) -> None:
        now = time.monotonic()
        self.arrivals.append(now)
        body = json.loads(msg.data)
        sent = body.get("payload", body).get("t", 0)
        if sent:
            self.latencies.append(now - sent)
            self.sent.append(sent)
        if len(self.arrivals) >= self.wanted:
            self.full.set()


async def count_outputs(
    b: Bench, n: int, within: float, period: float = 0.005
) -> tuple[float, float]:
    """(when the first output was stored, when the ``n``-th was), monotonic, from the output
    stream's message count every ``period`` seconds.

    A backlog run watches the count rather than subscribing: a subscriber in this process
    parses every output (MeshForge's carry headers, which nats-py parses character by
    character, and a whole envelope), and on two cores that CPU was taken from the worker
    it measured: 0.92 CPU seconds in a MeshForge run of 4.5 s, 0.37 in the nats-py loop's
    of 3.7 s. A request every 5 ms costs the same for every variant."""
    js = b.nc.jetstream()
    stream = OUTPUT_STREAMS[b.kind]
    deadline = time.monotonic() + within
    first = 0.0
    while True:
        stored = (await js.stream_info(stream)).state.messages
        now = time.monotonic()
        if stored and not first:
            first = now
        if stored >= n:
            return first, now
        if now > deadline:
            raise SystemExit(
                f"{b.kind}: {stored} of {n} outputs within {within:g}s\n{b.log_tail()}"
            )
        await asyncio.sleep(period)  # polling the stream's count with a deadline


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Bench:
    """One variant on its own fresh server."""

    kind: str
    server: EmbeddedServer
    nc: NATS
    work: Path
    proc: subprocess.Popen[bytes] | None = None
    store_url: str = ""

    @property
    def subjects(self) -> tuple[str, str]:
        return SUBJECTS[self.kind]

    async def streams(self) -> None:
        js = self.nc.jetstream()
        if self.kind in OUR:
            settings = load_settings({"nats_url": self.server.url}, env={})
            await ensure(js, default_streams(settings), [agent_consumer("echo", settings)])
            return
        await js.add_stream(name=STREAM_IN, subjects=["bench.in"])
        await js.add_stream(name=STREAM_OUT, subjects=["bench.out"])
        await js.add_consumer(
            STREAM_IN, durable_name=DURABLE, ack_policy="explicit", max_ack_pending=1000
        )

    def start(self) -> None:
        inp, out = self.subjects
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        }
        if self.kind in OUR:
            env["MESHFORGE_LOG_LEVEL"] = "WARNING"
            store = self.store_url or f"sqlite:///{self.work / 'store.db'}"
            agent = f"_variants:{AGENT_OF.get(self.kind, 'EchoAgent')}"
            args = meshforge_command("run", agent, "--store", store, "--nats-url", self.server.url)
            if self.kind == "mf-os":  # commits synced at checkpoints (docs/STORE.md)
                env["MESHFORGE_DURABILITY"] = "os"
            if self.kind == "mf-uvloop":  # its event-loop policy, which asyncio.run follows
                args[2] = "import uvloop; uvloop.install(); " + args[2]
        else:
            args = [
                sys.executable,
                str(HERE / "_variants.py"),
                self.kind,
                self.server.url,
                inp,
                out,
            ]
        log = (self.work / f"{self.kind}.log").open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    async def tap(self, wanted: int) -> Tap:
        tap = Tap(wanted=wanted)
        sub = await self.nc.subscribe(self.subjects[1], cb=tap.on)
        self.nc.deliver_direct(sub._id, tap.take)  # type: ignore[attr-defined]  # as read, no queue and task
        await self.nc.flush()
        return tap

    def log_tail(self) -> str:
        path = self.work / f"{self.kind}.log"
        return path.read_text()[-2000:] if path.exists() else ""


@contextmanager
def pg_database() -> Iterator[str]:
    """A PostgreSQL database of its own for one run, dropped after."""
    name = f"meshforge_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@asynccontextmanager
async def bench(kind: str, work: Path) -> AsyncIterator[Bench]:
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    with EmbeddedServer(store_dir=work / "nats") as server, ExitStack() as stack:
        # MeshForge's client: it parses headers (every output of ours has several) for a
        # fraction of nats-py's cost, on the cores the measured worker runs on.
        conn = await connect(
            load_settings({"nats_url": server.url}, env={}), url=server.url, name="bench"
        )
        b = Bench(kind, server, conn.nc, work)
        try:
            if kind == "pg":
                b.store_url = stack.enter_context(pg_database())
            await b.streams()
            yield b
        finally:
            b.stop()
            await conn.close()


async def wait_for(event: asyncio.Event, within: float, what: str, b: Bench) -> None:
    try:
        await asyncio.wait_for(event.wait(), within)
    except TimeoutError:
        raise SystemExit(f"{b.kind}: {what} not within {within:g}s\n{b.log_tail()}") from None
