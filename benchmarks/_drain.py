"""Drain a backlog of commands through one ``meshforge run`` worker process, sampling it.

``drain(n, settings)`` starts a fresh nats-server, publishes ``n`` commands for the
``DrainAgent`` below (one event out per command, each its own effect, spread over 1,000
resources), starts the worker, and every ``every``
seconds samples the worker's resident memory and the store's size (file plus WAL) until
the consumer has nothing left. The worker is its own OS process, as in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats

from meshforge.cli.demo_support import meshforge_command
from meshforge.config import load_settings
from meshforge.envelope import Envelope, Outbound
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.runtime import Agent, Event, Output, command
from meshforge.topology.provision import ensure
from meshforge.topology.specs import agent_consumer, default_streams
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.server import EmbeddedServer

HERE = Path(__file__).parent
SUBJECT = "cmd.default.bench.drain.work"
CHUNK = 20_000
RESOURCES = 1000  # commands spread over this many resources (accounts, orders, ...)


class Seen(msgspec.Struct):
    count: int = 0


class DrainAgent(Agent[Seen]):
    """``work {"id", "r", "blob"}`` emits ``worked {"id", "n"}`` on resource ``r``."""

    name = "drain"

    @command("work", key="r")
    def work(self, cmd: Envelope, state: Seen) -> list[Output]:
        return [Event("worked", {"id": cmd.payload["id"], "n": len(cmd.payload["blob"])})]

    def apply(self, state: Seen, event: Event) -> Seen:
        return Seen(count=state.count + 1)


@dataclass
class Sample:
    seconds: float  # since the worker started
    done: int  # commands acknowledged so far
    rss_mb: float
    store_bytes: int  # file plus WAL
    effects: int = 0  # effect rows in the store (with ``probe_store``)
    retained_bytes: int = 0  # effects, their outputs and inbox rows
    kept_bytes: int = 0  # the rest: event log, states, heads


RETAINED = ("meshforge_effects", "meshforge_inbox")  # an effect's outputs are in its row


def probe(db: Path) -> tuple[int, int, int]:
    """(effect rows, bytes of the retained tables, bytes of everything else) in the store.

    Read beside the running worker (WAL lets a reader in); sizes are the pages each
    table and its indexes use (SQLite's dbstat), free pages not counted.
    """
    if not db.exists():
        return 0, 0, 0
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as conn:
        try:
            effects = int(conn.execute("SELECT count(*) FROM meshforge_effects").fetchone()[0])
            owners = dict(conn.execute("SELECT name, tbl_name FROM sqlite_schema").fetchall())
            sizes = conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name").fetchall()
        except sqlite3.OperationalError:  # tables not created yet
            return 0, 0, 0
    retained = sum(size for name, size in sizes if owners.get(name, name) in RETAINED)
    return effects, retained, sum(size for _, size in sizes) - retained


@dataclass
class Drained:
    n: int
    seconds: float
    samples: list[Sample] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.n / self.seconds


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def store_bytes(db: Path) -> int:
    return sum(p.stat().st_size for p in (db, db.with_name(db.name + "-wal")) if p.exists())


async def publish_backlog(url: str, n: int) -> None:
    """``n`` commands in chunks (memory stays bounded for a million)."""
    nc = await nats.connect(url)
    publisher = Publisher(nc.jetstream(), metrics=Metrics())
    blob = "x" * 128
    for start in range(0, n, CHUNK):
        items = [
            Outbound.of(
                SUBJECT,
                Envelope.new(
                    "drain.work",
                    {"id": f"c{i}", "r": f"r{i % RESOURCES}", "blob": blob},
                    id=f"c{i}",
                ),
            )
            for i in range(start, min(n, start + CHUNK))
        ]
        await publisher.publish_many(items)
    await nc.close()


async def drain(
    n: int,
    values: dict[str, Any],
    *,
    every: float = 2.0,
    limit: float = 3600.0,
    probe_store: bool = False,
    enough: float | None = None,
) -> Drained:
    """Publish ``n`` commands, run one worker with ``values`` as its settings, sample it;
    with ``enough`` (seconds), stop sampling then even if commands are left (the result
    counts those done)."""
    with tempfile.TemporaryDirectory(prefix="mf-drain-") as tmp:
        work = Path(tmp)
        db = work / "store.db"
        with EmbeddedServer(store_dir=work / "nats") as server:
            settings = load_settings({**values, "nats_url": server.url}, env={})
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            await ensure(js, default_streams(settings), [agent_consumer("drain", settings)])
            await publish_backlog(server.url, n)
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            }
            env.update({f"MESHFORGE_{k.upper()}": str(v) for k, v in values.items()})
            env["MESHFORGE_LOG_LEVEL"] = "WARNING"
            args = meshforge_command(
                "run", "_drain:DrainAgent", "--store", f"sqlite:///{db}", "--nats-url", server.url
            )
            log = (work / "worker.log").open("ab")
            proc = await asyncio.to_thread(
                subprocess.Popen, args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE
            )
            started = time.monotonic()
            result = Drained(n, 0.0)
            try:
                while True:
                    await asyncio.sleep(every)
                    if proc.poll() is not None:
                        raise SystemExit(
                            f"the worker exited ({proc.returncode}):\n{(work / 'worker.log').read_text()[-2000:]}"
                        )
                    info = await js.consumer_info(STREAM_COMMANDS, "drain_consumer")
                    done = n - info.num_pending - info.num_ack_pending
                    elapsed = time.monotonic() - started
                    sample = Sample(elapsed, done, rss_mb(proc.pid), store_bytes(db))
                    if probe_store:
                        (
                            sample.effects,
                            sample.retained_bytes,
                            sample.kept_bytes,
                        ) = await asyncio.to_thread(probe, db)
                    result.samples.append(sample)
                    if done >= n or (enough is not None and elapsed >= enough):
                        result.n, result.seconds = done, elapsed
                        return result
                    if elapsed > limit:
                        raise SystemExit(f"drained {done:,} of {n:,} in {limit:g}s; giving up")
            finally:
                proc.terminate()
                try:
                    await asyncio.to_thread(proc.wait, 30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    await asyncio.to_thread(proc.wait)
                log.close()
                await nc.close()


def quarter_max(samples: list[Sample], value: str, quarter: int) -> float:
    """The largest ``value`` among the samples of one quarter (0-3) of the run's progress."""
    n = max(s.done for s in samples) or 1
    inside = [
        getattr(s, value) for s in samples if quarter * n / 4 <= s.done <= (quarter + 1) * n / 4
    ]
    return max(inside) if inside else 0.0


if __name__ == "__main__":
    sys.exit("run bench_rss.py or bench_storage.py")
