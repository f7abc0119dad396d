"""The order checker: a random workload over ~50 resources with planned transient failures,
``Retry``, slow handlers and unrecoverable commands, while 2-3 real worker processes get
SIGKILL, SIGSTOP/SIGCONT, graceful stops and starts (so partitions are handed over and
taken over); then ``order_oracle.check`` judges every resource from outside (the streams
and the store).

The workload is seeded: a failure prints its seed, and the same seed replays the same
commands and the same fault schedule (the timing of real processes still varies).
Runnable on its own for longer runs::

    .venv/bin/python tests/chaos/order_checker.py --seconds 600 --store postgresql://...
    .venv/bin/python tests/chaos/order_checker.py --seed 1234 --seconds 40
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from order_checker_agent import AGENT, ATTEMPTS_ENV
from order_oracle import Command, Outcome, WireEvent, check

from meshforge.cli.demo_support import AgentProcess, read_stream
from meshforge.config import Settings, load_settings
from meshforge.envelope import Envelope, Outbound
from meshforge.publish.publisher import Publisher
from meshforge.store import open_store
from meshforge.topology.partitions import ensure_bucket, partitioned
from meshforge.topology.provision import ensure
from meshforge.topology.scope import Scope
from meshforge.topology.specs import agent_consumer, default_streams, partition_consumers
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_EVENTS, STREAM_FAILED
from meshforge.transport.connection import Connection, connect
from meshforge.transport.server import EmbeddedServer

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
TENANT, NAMESPACE = "default", "chaos"
SUBJECT = f"cmd.{TENANT}.{NAMESPACE}.{AGENT}.step"
SPEC = "order_checker_agent:OrderCheckerAgent"
ACK_WAIT = 2.0  # handlers time out at half of it: slow ones sleep 0.4-0.8 s, past a third
# Deliveries never run out: only the commands planned to fail for good are dead letters.
WORKER_ENV = {
    "MESHFORGE_ACK_WAIT": f"{ACK_WAIT:g}s",
    "MESHFORGE_BACKOFF": "0.5s,1s",
    "MESHFORGE_MAX_DELIVER": "1000",
    "MESHFORGE_BATCH_SIZE": "4",  # a worker holds at most 48 (3 groups of 4 fetches): bursts pass that
    "MESHFORGE_PARTITION_LEASE": "1.5s",
    "MESHFORGE_SHUTDOWN_TIMEOUT": "5s",
    "MESHFORGE_LOG_LEVEL": "WARNING",
}


def scale() -> int:
    """CHAOS_SCALE (``make chaos`` sets 20) multiplies the run's length."""
    return max(1, int(os.environ.get("CHAOS_SCALE", "1")))


def seed_from_env() -> int:
    """ORDER_CHECKER_SEED replays a run; otherwise a fresh seed (printed on failure)."""
    given = os.environ.get("ORDER_CHECKER_SEED")
    return int(given) if given else random.SystemRandom().randrange(1, 10**9)


# ------------------------------------------------------------------ the workload


@dataclass(frozen=True, slots=True)
class Planned:
    """One command to send: its envelope and its plan (``order_oracle.Command`` once stored)."""

    env: Envelope
    resource: str
    n: int
    plan: str
    fatal: bool


def plan_commands(
    rng: random.Random, resources: int, count: int, *, transient: bool = True
) -> list[Planned]:
    """``count`` commands over ``resources`` resources, in a random interleaving, each with
    its faults: ~10% fail transiently, ~8% ``Retry`` (none of these two unless
    ``transient``), ~3% are slow, ~2% fail for good."""
    next_n: Counter[str] = Counter()
    out = []
    for _ in range(count):
        resource = f"r{rng.randrange(resources):02d}"
        next_n[resource] += 1
        n = next_n[resource]
        payload: dict[str, Any] = {"n": n}
        roll = rng.random()
        if not transient and roll < 0.18:
            pass
        elif roll < 0.10:
            payload["fail"] = rng.randint(1, 3)
        elif roll < 0.18:
            payload["retry"] = rng.randint(1, 2)
            payload["delay"] = round(rng.uniform(0.1, 1.5), 2)
        elif roll < 0.21:
            payload["sleep"] = round(rng.uniform(0.4, 0.8), 2)
        elif roll < 0.23:
            payload["fatal"] = True
        plan = " ".join(f"{k}={v}" if v is not True else k for k, v in payload.items() if k != "n")
        env = Envelope.new(
            f"{AGENT}.step", payload, resource_id=resource, tenant_id=TENANT, source="order-checker"
        )
        out.append(Planned(env, resource, n, plan, bool(payload.get("fatal"))))
    return out


# ------------------------------------------------------------------ the run


@dataclass
class Fleet:
    """The worker processes and what was done to them."""

    workers: list[AgentProcess]
    stopped: set[int] = field(default_factory=set)  # indexes under SIGSTOP
    faults: Counter[str] = field(default_factory=Counter)

    def running(self) -> list[int]:
        return [i for i, w in enumerate(self.workers) if w.alive and i not in self.stopped]

    def idle(self) -> list[int]:
        return [i for i, w in enumerate(self.workers) if not w.alive]


@dataclass
class OrderRun:
    """One checker run against a server and a store."""

    url: str
    store_url: str
    work: Path
    seed: int
    partitions: int = 3
    resources: int = 50
    workers: int = 3
    transient: bool = True  # planned transient failures and Retry
    kills: bool = True  # SIGKILL, SIGSTOP, SIGTERM and starts of workers
    sent: list[Command] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    log_lines: list[str] = field(default_factory=list)

    def settings(self) -> Settings:
        return load_settings({
            "nats_url": self.url, "partitions": self.partitions, "max_deliver": 1000,
            "backoff": (0.5, 1.0), "ack_wait": ACK_WAIT, "partition_lease": 1.5,
        }, env={})  # fmt: skip

    def note(self, line: str) -> None:
        self.log_lines.append(f"{time.strftime('%H:%M:%S')} {line}")

    async def provision(self, conn: Connection) -> None:
        settings = self.settings()
        if self.partitions:
            consumers = list(partition_consumers(AGENT, settings).values())
            await ensure_bucket(conn.js, settings)
        else:
            consumers = [agent_consumer(AGENT, settings)]
        await ensure(conn.js, default_streams(settings), consumers)

    def fleet(self) -> Fleet:
        attempts = self.work / "attempts"
        attempts.mkdir(exist_ok=True)
        path = os.pathsep.join([str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        env = {**WORKER_ENV, ATTEMPTS_ENV: str(attempts), "PYTHONPATH": path,
               "MESHFORGE_PARTITIONS": str(self.partitions)}  # fmt: skip
        return Fleet([
            AgentProcess(SPEC, self.store_url, self.url, self.work / f"worker{i}.log", env=env,
                         extra_args=["--no-provision"])
            for i in range(self.workers)
        ])  # fmt: skip

    async def run(self, seconds: float) -> Outcome:
        """Send the workload for ``seconds`` under faults, let the work finish, judge it."""
        rng = random.Random(self.seed)
        planned = plan_commands(
            rng, self.resources, count=int(seconds * 15), transient=self.transient
        )
        conn = await connect(load_settings({"nats_url": self.url}, env={}), name="order-checker")
        fleet = self.fleet()
        self.faults = fleet.faults
        try:
            await self.provision(conn)
            for i in range(2):
                fleet.workers[i].start()
            publishing = asyncio.create_task(
                self._publish(conn, planned, seconds, random.Random(rng.random()))
            )
            await self._faults(fleet, seconds, random.Random(rng.random()), publishing)
            await publishing
            await self._settle(conn, fleet, within=90.0 + 10 * seconds / 40)
            for w in fleet.workers:
                code = await asyncio.to_thread(w.stop, 20)
                if code not in (None, 0, -signal.SIGTERM):
                    self.note(f"worker {w.log_path.name} stopped with {code}")
            return await self._judge(conn)
        finally:
            for i in list(fleet.stopped):
                proc = fleet.workers[i].proc
                if proc is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGCONT)
            for w in fleet.workers:
                w.kill()
            await conn.close()

    async def _publish(
        self, conn: Connection, planned: list[Planned], seconds: float, rng: random.Random
    ) -> None:
        """Small random batches at a steady pace, so later commands of a resource arrive
        after its earlier ones were tried (and failed); now and then a burst, so a worker
        holds more than it may and a hand-over finds a backlog."""
        publisher = Publisher(conn.js, self.settings())
        settings = self.settings()
        started = time.monotonic()
        i = 0
        while i < len(planned):
            batch = planned[
                i : i + (rng.randint(60, 150) if rng.random() < 0.03 else rng.randint(1, 12))
            ]
            items = [Outbound.of(partitioned(SUBJECT, p.env, settings), p.env) for p in batch]
            results = await publisher.publish_many(items)
            for p, r in zip(batch, results, strict=True):
                self.sent.append(Command(p.env.id, p.resource, p.n, r.seq, p.plan, p.fatal))
            i += len(batch)
            due = started + seconds * i / len(planned)
            await asyncio.sleep(max(0.0, due - time.monotonic()))  # pacing the workload, not a wait

    async def _faults(
        self, fleet: Fleet, seconds: float, rng: random.Random, publishing: asyncio.Task[None]
    ) -> None:
        """A fault every 0.5-2.5 s until the workload is sent: kill, stop, hand back, start."""
        end = time.monotonic() + seconds
        conts: list[asyncio.Task[None]] = []
        if not self.kills:
            return
        while time.monotonic() < end and not publishing.done():
            await asyncio.sleep(rng.uniform(0.5, 2.5))  # the fault schedule's pace
            running, idle = fleet.running(), fleet.idle()
            action = rng.choice(["kill", "stop", "term", "start", "kill", "stop"])
            if action == "start" or len(running) < 2:
                if idle:
                    i = rng.choice(idle)
                    fleet.workers[i].start()
                    fleet.faults["start"] += 1
                    self.note(f"start worker{i}")
                continue
            i = rng.choice(running)
            proc = fleet.workers[i].proc
            assert proc is not None
            if action == "kill":
                fleet.workers[i].kill()
                fleet.faults["sigkill"] += 1
                self.note(f"SIGKILL worker{i}")
            elif action == "term":
                await asyncio.to_thread(
                    fleet.workers[i].stop, 20
                )  # a clean hand-back, work in flight
                fleet.faults["sigterm"] += 1
                self.note(f"SIGTERM worker{i}")
            else:
                pause = rng.uniform(0.3, 4.0)  # past the 1.5 s lease most times: taken over
                os.kill(proc.pid, signal.SIGSTOP)
                fleet.stopped.add(i)
                fleet.faults["sigstop"] += 1
                self.note(f"SIGSTOP worker{i} for {pause:.1f}s")
                conts.append(asyncio.create_task(self._cont(fleet, i, pause)))
        for task in conts:
            await task

    async def _cont(self, fleet: Fleet, i: int, pause: float) -> None:
        await asyncio.sleep(pause)  # the length of the stall is the fault
        proc = fleet.workers[i].proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        fleet.stopped.discard(i)

    async def _settle(self, conn: Connection, fleet: Fleet, within: float) -> None:
        """Two workers running until every command has left the commands stream."""
        for i in fleet.idle()[: max(0, 2 - len(fleet.running()))]:
            fleet.workers[i].start()
        deadline = time.monotonic() + within
        while True:
            info = await conn.js.stream_info(STREAM_COMMANDS)
            if info.state.messages == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"seed {self.seed}: {info.state.messages} commands still unprocessed after {within:g}s;"
                    f" workers alive: {[w.alive for w in fleet.workers]}"
                )
            await asyncio.sleep(0.2)  # polling the stream against the deadline

    async def _judge(self, conn: Connection) -> Outcome:
        events = await read_stream(conn.js, STREAM_EVENTS, f"evt.{TENANT}.{NAMESPACE}.{AGENT}.>")
        failed = await read_stream(
            conn.js, STREAM_FAILED, f"failed.cmd.{TENANT}.{NAMESPACE}.{AGENT}.>"
        )
        left = (await conn.js.stream_info(STREAM_COMMANDS)).state.messages
        wire = []
        for m in events:
            env = m.envelope()
            assert env is not None, f"undecodable event at seq {m.seq}"
            msg_id = m.headers.get("Nats-Msg-Id", env.id)
            wire.append(
                WireEvent(
                    msg_id,
                    env.causation_id or "",
                    int(env.payload["n"]),
                    int(env.payload["at"]),
                    m.seq,
                )
            )
        dead = []
        for m in failed:
            env = m.envelope()
            dead.append(env.id if env is not None else m.headers.get("Nats-Msg-Id", "?"))
        states, log = await asyncio.to_thread(self._read_store)
        return check(self.sent, dead_letters=dead, states=states, log=log, wire=wire, left=left,
                     ordered=self.partitions > 0)  # fmt: skip

    def _read_store(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        scope = Scope(TENANT, NAMESPACE)
        decoder = msgspec.json.Decoder(dict[str, Any])
        store = open_store(self.store_url)
        try:
            states: dict[str, list[int]] = {}
            with store.transaction() as tx:
                for resource in sorted({c.resource for c in self.sent}):
                    raw = tx.state_get(AGENT, resource, scope=scope)
                    states[resource] = [] if raw is None else list(decoder.decode(raw)["applied"])
            log: dict[str, list[int]] = {}
            for event in store.events_read(AGENT, scope=scope):
                log.setdefault(event.resource_id or "", []).append(
                    int(decoder.decode(event.data)["n"])
                )
            return states, log
        finally:
            store.close()


def report(run: OrderRun, outcome: Outcome) -> str:
    """The verdict in a few lines; every violation, and the seed to replay it."""
    faults = ", ".join(f"{n} {k}" for k, n in sorted(run.faults.items())) or "no faults"
    head = (f"seed {run.seed}: {len(run.sent)} commands over {run.resources} resources, "
            f"{outcome.applied} applied, {outcome.dead_lettered} dead-lettered, {faults}, "
            f"{outcome.inversions} wire-order inversions (re-publishes; not judged)")  # fmt: skip
    if outcome.ok:
        return head + ": order and exactly-once hold"
    logs = " ".join(p.read_text(errors="replace") for p in sorted(run.work.glob("worker*.log")))
    head += (f"; worker logs in {run.work}: {logs.count('transient failure')} transient failures,"
             f" {logs.count('handler timed out')} of them handler timeouts")  # fmt: skip
    shown = outcome.violations[:25]
    more = len(outcome.violations) - len(shown)
    return "\n".join([f"{head}: {len(outcome.violations)} VIOLATION(S); replay with ORDER_CHECKER_SEED={run.seed}",
                      *shown, *([f"... and {more} more"] if more else [])])  # fmt: skip


async def checked_run(url: str, store_url: str, work: Path, *, seed: int, seconds: float,
                      partitions: int = 3, calm: bool = False, transient: bool = True,
                      ) -> tuple[OrderRun, Outcome]:  # fmt: skip
    """One run; ``calm``: no transient failures and no worker faults (slow handlers and
    dead letters only), which today's code must pass: the checker's own control."""
    run = OrderRun(
        url,
        store_url,
        work,
        seed,
        partitions=partitions,
        transient=transient and not calm,
        kills=not calm,
    )
    return run, await run.run(seconds)


async def assert_order_holds(
    url: str, store_url: str, work: Path, *, seconds: float, partitions: int = 3
) -> None:
    """A run of ``seconds`` (times CHAOS_SCALE) that must show no violation and real faults."""
    run, outcome = await checked_run(url, store_url, work, seed=seed_from_env(), seconds=seconds * scale(),
                                     partitions=partitions)  # fmt: skip
    verdict = report(run, outcome)
    print(verdict)  # the seed and the figures, in the test's captured output
    assert outcome.ok, verdict
    assert sum(run.faults.values()) >= 5, f"too few faults to mean anything: {verdict}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--store", default=None, help="a store URL (default: SQLite in a temp dir)")
    parser.add_argument(
        "--partitions", type=int, default=3, help="0: the workers share one durable"
    )
    parser.add_argument(
        "--calm", action="store_true", help="no transient failures, no worker faults"
    )
    parser.add_argument("--no-transient", action="store_true", help="worker faults only")
    args = parser.parse_args()
    seed = args.seed or seed_from_env()
    with tempfile.TemporaryDirectory(prefix="meshforge-order-") as tmp:
        work = Path(tmp)
        with EmbeddedServer(store_dir=work / "nats") as server:
            store = args.store or f"sqlite:///{work / 'store.db'}?busy_timeout=30000"
            run, outcome = asyncio.run(checked_run(server.url, store, work, seed=seed, seconds=args.seconds,
                                                   partitions=args.partitions, calm=args.calm,
                                                   transient=not args.no_transient))  # fmt: skip
        print(report(run, outcome))  # while the worker logs it names still exist
        print("\n".join(run.log_lines[-40:]))
    sys.exit(0 if outcome.ok else 1)


if __name__ == "__main__":
    main()
