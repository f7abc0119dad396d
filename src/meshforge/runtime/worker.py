"""A worker process: load agents, wire connection, store, consumers and engines, run until told.

Example::

    worker = Worker([load_agent("meshforge.demo:OrderAgent")], load_settings())
    worker.install_signal_handlers()      # SIGINT/SIGTERM: finish in-flight work, then stop
    await worker.run()

Several workers of one agent may run at once (on several machines): they share the
agent's durable consumer, and the store (PostgreSQL for more than one machine) keeps
each command's effect single. A worker bound to a tenant or namespace (``Settings.tenant``,
``MESHFORGE_TENANT``; ``namespace``) has its own durable, ``<agent>_consumer_<tenant>_<ns>``;
it cannot run beside an unbound worker of the same agent, whose filter overlaps its own
on the work-queue stream: provisioning refuses that, naming both consumers.

With ``partitions = N`` (``MESHFORGE_PARTITIONS``) each agent's commands are split by
resource over N durables plus one for unpartitioned subjects (``meshforge.topology.partitions``);
the workers share them out through leases, and each runs one consumer per partition it
owns, spread over ``LANES`` engines of the agent (each one transaction in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

from meshforge.config import Settings, load_settings
from meshforge.consume.consumer import Consumer
from meshforge.consume.decisions import Decision, Delivery, Handler
from meshforge.consume.work import Budget
from meshforge.deadletters.route import REASONS
from meshforge.errors import ConfigError, one_line
from meshforge.ops.observability import HttpEndpoint, Metrics, serve_http
from meshforge.ops.probes import DEFAULT_PROBE_INTERVAL, Probes
from meshforge.ops.retention import store_retention
from meshforge.publish.publisher import Publisher
from meshforge.runtime.activity import summarize
from meshforge.runtime.agent import Agent
from meshforge.runtime.engine import Engine, consumer_name
from meshforge.runtime.holds import Holds, seed_from_stream, stream_has
from meshforge.runtime.killswitch import KillSwitch
from meshforge.store import open_store
from meshforge.store.base import Store
from meshforge.topology.ownership import Ownership, Tenure
from meshforge.topology.partitions import ensure_bucket, lease_of, open_bucket
from meshforge.topology.provision import ensure, verify
from meshforge.topology.specs import (
    ConsumerSpec,
    agent_consumer,
    default_streams,
    partition_consumers,
)
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_EVENTS, STREAM_FAILED
from meshforge.transport.connection import Connection, connect

__all__ = ["SWITCH_INTERVAL", "Worker", "import_from_cwd", "load_agent", "quick_thread_switches"]

log = logging.getLogger("meshforge.worker")
_AGENT_STREAMS = (STREAM_COMMANDS, STREAM_EVENTS, STREAM_FAILED)
# Engines per partitioned agent: the transactions one worker keeps in flight at once (while
# one waits on the store, another runs its handlers), each partition in one of them.
LANES = 2


def import_from_cwd() -> None:
    """Let ``MODULE:AGENT`` name modules of the current directory, as ``python -m`` would."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def load_agent(spec: str) -> Agent[Any]:
    """The agent named ``MODULE:AGENT`` (a class, instantiated, or an instance).

    >>> load_agent("meshforge.demo:OrderAgent").name
    'order'
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"agent {spec!r}: expected MODULE:AGENT, e.g. meshforge.demo:OrderAgent")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"agent {spec!r}: cannot import {module_name!r}: {one_line(exc)}"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"agent {spec!r}: module {module_name!r} has no {attr!r}")
    if isinstance(target, type) and issubclass(target, Agent):
        return target()
    if isinstance(target, Agent):
        return target
    raise ConfigError(f"agent {spec!r}: {attr!r} is not an Agent subclass")


def _one_by_one(engine: Engine[Any]) -> Handler:
    """The engine's batch handler as a handler of one delivery (push delivers one by one)."""

    async def handle(delivery: Delivery) -> Decision:
        return (await engine.handle([delivery]))[0]

    return handle


# The interpreter's default: a thread that wants the GIL waits up to this long for it.
_DEFAULT_SWITCH = 0.005
SWITCH_INTERVAL = 0.0005


def quick_thread_switches() -> None:
    """Let a thread waiting for the GIL have it within 0.5 ms instead of 5 (unless the
    program chose its own interval).

    Each engine's store thread takes the GIL back after every SQL statement and COMMIT;
    with the default interval it waited up to 5 ms each time the event loop was busy, and
    commands at a steady 1,000 a second saw p99 latencies of 30 ms (benchmarks/RESULTS.md).
    """
    if sys.getswitchinterval() == _DEFAULT_SWITCH:
        sys.setswitchinterval(SWITCH_INTERVAL)


def freeze_start_up_heap() -> None:
    """Take every object alive now (modules, classes, the loaded agents) out of the cyclic
    garbage collector's sight, for a process that runs workers and nothing else.

    A full collection walks every tracked object: about 30 ms in a worker, the first one
    about a second into a steady load, seen as the worst latencies of that second
    (benchmarks/RESULTS.md). Objects frozen here are never collected as cycles, which is why
    ``meshforge run`` calls this and ``Worker.run`` does not: a program embedding a worker
    decides for itself (``gc.freeze()``).
    """
    gc.collect()
    gc.freeze()


def _reads_commands(settings: Settings) -> bool:
    """Whether this worker reads what a durable left unacknowledged (by sequence, which is
    not limited to a tenant's subjects: a worker bound to a tenant does without)."""
    return not (settings.tenant or settings.namespace)


class _Partitions:
    """Runs the partition durables of one agent that this worker owns, over its engines.

    Who owns what is the ``Ownership``'s business: it calls ``start`` with a ``Tenure``
    for each slot it takes and ``stop`` for each it gives up. Each engine (a lane) has one
    transaction in flight; a partition runs in the lane with the fewest partitions when it
    starts, so its commands keep their order while the lanes' transactions overlap.
    """

    def __init__(
        self, conn: Connection, specs: dict[str, ConsumerSpec], engines: list[Engine[Any]],
        publisher: Publisher, settings: Settings, metrics: Metrics,
    ) -> None:  # fmt: skip
        self.conn, self.specs, self.engines = conn, specs, engines
        self.publisher, self.settings, self.metrics = publisher, settings, metrics
        self.lanes: dict[str, int] = {}
        # A lane's partitions share its room for held commands: what one engine can reach
        # within an ack wait, not that once for each of its durables.
        self.budgets = [Budget() for _ in engines]
        self.consumers: dict[str, Consumer] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def start(self, tenure: Tenure) -> None:
        slot = tenure.slot
        lane = self.lanes.get(slot)
        if lane is None:  # else still stopping there: the same lane keeps its order
            load = [0] * len(self.engines)
            for taken in self.lanes.values():
                load[taken] += 1
            lane = self.lanes[slot] = load.index(min(load))
        engine = self.engines[lane]
        consumer = Consumer(
            self.conn, tenure.spec, batch_handler=engine.handle, settings=self.settings,
            metrics=self.metrics, publisher=self.publisher, provision=False,
            batch_size=engine.fetch_size, max_held=engine.max_held, max_deliver=None,
            owner=tenure, pause=engine.kill_switch, budget=self.budgets[lane],
        )  # fmt: skip
        self.consumers[slot] = consumer
        self.tasks[slot] = asyncio.create_task(self._run(tenure, consumer))

    async def read_held(self, spec: ConsumerSpec) -> int | None:
        """What the durable's previous owner left unacknowledged holds back its resources'
        later commands (None: this worker cannot read it); the counts of held deliveries
        it kept are read again."""
        found = None
        if _reads_commands(self.settings):
            engine = self.engines[0]  # the lanes share one Holds
            found = await seed_from_stream(engine.holds, self.conn.js, spec, engine.slot_of)
        for lane in self.engines:
            lane.reload_holds()
        return found

    async def _run(self, tenure: Tenure, consumer: Consumer) -> None:
        try:
            await tenure.claim()
            await consumer.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not self.failed.done():
                self.failed.set_exception(exc)

    async def stop(self, slot: str) -> None:
        consumer, task = self.consumers.pop(slot, None), self.tasks.pop(slot, None)
        if consumer is None or task is None:
            return
        if consumer.ready.is_set() or task.done():
            await consumer.stop(self.settings.shutdown_timeout)
        else:
            task.cancel()  # still claiming: nothing in flight
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if slot not in self.consumers:  # not started again meanwhile
            self.lanes.pop(slot, None)


class Worker:
    """Runs one or more agents on one connection and one store until ``stop()``."""

    def __init__(
        self,
        agents: Sequence[Agent[Any]],
        settings: Settings | None = None,
        *,
        store: Store | None = None,
        metrics: Metrics | None = None,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
        probe_interval: float = DEFAULT_PROBE_INTERVAL,
        deliver_group: str | None = None,
    ) -> None:
        if not agents:
            raise ConfigError("no agent to run: name at least one MODULE:AGENT")
        names = [a.name for a in agents]
        if len(set(names)) != len(names):
            raise ConfigError(f"agent names must differ within one worker, got {names}")
        self.agents = list(agents)
        self.settings = settings or load_settings()
        self.metrics = metrics or Metrics()
        self.metrics_port = metrics_port if metrics_port is not None else self.settings.metrics_port
        self.metrics_host = metrics_host or self.settings.metrics_host
        self.probe_interval = probe_interval
        # A deliver group: push consumers whose members share the messages (else pull).
        self.deliver_group = deliver_group
        self.ready = asyncio.Event()
        self._store = store
        self._own_store = store is None
        self._consumers: list[Consumer] = []
        self._ownerships: list[Ownership] = []
        self._partitions: list[_Partitions] = []
        self._engines: list[Engine[Any]] = []
        self._stopping = asyncio.Event()
        self._conn: Connection | None = None
        self._endpoint: HttpEndpoint | None = None
        self._probes: asyncio.Task[None] | None = None
        #: Open while an outage (of the store) pauses the work: /readyz says 503 meanwhile.
        self.kill_switch = KillSwitch(self.metrics)
        self._durables: dict[str, str] = {}  # durable -> agent, for the activity summary
        self.metrics.track(self.is_ready, self._connected)

    async def run(self) -> None:
        """Connect, provision (unless disabled), consume until ``stop()``, then clean up.

        ``stop()`` (or a signal) while starting ends the start where it is: a worker that
        cannot reach its server, or waits on it, still stops when told.
        """
        settings = self.settings
        quick_thread_switches()
        stop = asyncio.ensure_future(self._stopping.wait())
        retention: asyncio.Task[None] | None = None
        activity: asyncio.Task[None] | None = None
        try:
            setup = asyncio.ensure_future(self._setup())
            await asyncio.wait({setup, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not setup.done():
                setup.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await setup
                log.info("stopped while starting")
                return
            setup.result()
            runs = [asyncio.create_task(c.run()) for c in self._consumers]
            activity = asyncio.create_task(summarize(self.metrics, self._durables, self._stopping))
            # Effects and inbox rows past their retention are deleted while the worker runs.
            if self._store is not None:
                retention = asyncio.create_task(
                    store_retention(
                        self._store, effect_retention=settings.effect_retention,
                        inbox_retention=settings.inbox_retention,
                        interval=settings.retention_interval, stop=self._stopping,
                    )
                )  # fmt: skip
            rounds = [asyncio.Event() for _ in self._ownerships]
            owning = [
                asyncio.create_task(o.run(ev))
                for o, ev in zip(self._ownerships, rounds, strict=True)
            ]
            runs += owning
            await self._wait_ready(runs, stop, rounds)
            if not stop.done():
                self.ready.set()
                log.info("running %s", ", ".join(a.name for a in self.agents))
            failures = [p.failed for p in self._partitions]
            until: list[asyncio.Future[Any]] = [*runs, *failures, stop]
            await asyncio.wait(until, return_when=asyncio.FIRST_COMPLETED)
            for task in owning:
                task.cancel()
            # No round may run beside the hand-back below.
            await asyncio.gather(*owning, return_exceptions=True)
            await asyncio.gather(
                *(c.stop(settings.shutdown_timeout) for c in self._consumers),
                *(o.close() for o in self._ownerships),
            )
            results: list[BaseException | None] = list(
                await asyncio.gather(*runs, return_exceptions=True)
            )
            results += [f.exception() for f in failures if f.done()]
            for result in results:
                if isinstance(result, BaseException) and not isinstance(
                    result, asyncio.CancelledError
                ):
                    raise result
        finally:
            stop.cancel()
            self.kill_switch.stop()
            if activity is not None:
                activity.cancel()
            if retention is not None:
                retention.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await retention
            for part in self._partitions:
                for task in part.tasks.values():
                    task.cancel()
            self.ready.clear()
            if self._probes is not None:
                self._probes.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._probes
            if self._endpoint is not None:
                await self._endpoint.close()
                self._endpoint = None
            for engine in self._engines:
                await asyncio.to_thread(engine.close)
            if self._conn is not None:
                await self._conn.close()
            if self._own_store and self._store is not None:
                await asyncio.to_thread(self._store.close)

    async def _setup(self) -> None:
        """Store, connection, topology, then one engine and one consumer per agent."""
        settings = self.settings
        if self.metrics_port is not None:
            # First, so a port in use fails at once; /readyz says 503 until consuming.
            self._endpoint = await serve_http(
                self.metrics_host, self.metrics_port, self.metrics, self._health, self.is_ready
            )
            log.info("metrics on %s:%d", self._endpoint.host, self._endpoint.port)
        if self._store is None:
            self._store = await asyncio.to_thread(
                partial(open_store, durability=settings.durability), settings.store_url
            )
        if settings.partitions and self.deliver_group:
            raise ConfigError("partitions need pull consumers: run without --push/--deliver-group")
        self._conn = conn = await connect(
            settings, name=f"meshforge-{'-'.join(a.name for a in self.agents)}"
        )
        conn.on_state.append(self._server_state)
        specs = [agent_consumer(a.name, settings) for a in self.agents]
        parted = (
            [partition_consumers(a.name, settings) for a in self.agents]
            if settings.partitions
            else []
        )
        # A push consumer is made by its Consumer (it needs the deliver group): streams only.
        pulled = [] if self.deliver_group else specs
        if parted:
            pulled = [spec for group in parted for spec in group.values()]
        if settings.provision:
            await ensure(conn.js, default_streams(settings), pulled)
            kv = await ensure_bucket(conn.js, settings) if parted else None
        else:
            # Least privilege: only what agents use must exist (not the control plane's).
            needed = [s for s in default_streams(settings) if s.name in _AGENT_STREAMS]
            await verify(conn.js, needed, pulled)
            kv = await open_bucket(conn.js) if parted else None
        publisher = Publisher(conn.js, settings, self.metrics)
        consumed = pulled if parted else specs  # the durables this worker may consume
        owner = {spec.durable: a.name for a, spec in zip(self.agents, specs, strict=True)}
        for a, group in zip(self.agents, parted, strict=False):
            owner |= {spec.durable: a.name for spec in group.values()}
        self._durables = {spec.durable: owner.get(spec.durable, spec.durable) for spec in consumed}
        for spec in consumed:
            self.metrics.prepare_consumer(spec.durable, REASONS)
        for index, (agent, spec) in enumerate(zip(self.agents, specs, strict=True)):
            holds = Holds(
                consumer_name(agent.name), present=partial(stream_has, conn.js, STREAM_COMMANDS)
            )
            switch = self.kill_switch
            engine = Engine(agent, self._store, publisher, settings=settings, metrics=self.metrics,
                            holds=holds, kill_switch=switch)  # fmt: skip
            self._engines.append(engine)
            if kv is not None:
                group = parted[index]
                lanes = [engine] + [
                    Engine(
                        agent,
                        self._store,
                        publisher,
                        settings=settings,
                        metrics=self.metrics,
                        holds=holds,
                        kill_switch=switch,
                    )
                    for _ in range(min(LANES, len(group)) - 1)
                ]
                self._engines += lanes[1:]
                part = _Partitions(conn, group, lanes, publisher, settings, self.metrics)
                self._partitions.append(part)
                ownership = Ownership(
                    conn.js, kv, group, run=part.start, stop=part.stop, period=await lease_of(kv) / 3,
                    read_held=part.read_held, last_error=lambda: conn.last_error,
                )  # fmt: skip
                self._ownerships.append(ownership)
                continue
            if self.deliver_group:
                consumer = Consumer(
                    conn, spec, handler=_one_by_one(engine), settings=settings, mode="push",
                    deliver_group=self.deliver_group, metrics=self.metrics, publisher=publisher,
                    provision=settings.provision, max_deliver=None,
                )  # fmt: skip
            else:
                consumer = Consumer(
                    conn, spec, batch_handler=engine.handle, settings=settings,
                    metrics=self.metrics, publisher=publisher, provision=False,
                    batch_size=engine.fetch_size, max_held=engine.max_held, max_deliver=None,
                    pause=self.kill_switch,
                )  # fmt: skip
                if _reads_commands(settings):
                    await seed_from_stream(holds, conn.js, spec, engine.slot_of)
            self._consumers.append(consumer)
        probes = Probes(
            conn.js, self.metrics, [(s.stream, s.durable) for s in consumed], store=self._store
        )
        self._probes = asyncio.create_task(probes.run(self.probe_interval))

    @property
    def endpoint(self) -> HttpEndpoint | None:
        """The running /healthz /readyz /metrics endpoint (None without a metrics port)."""
        return self._endpoint

    def is_ready(self) -> bool:
        """Consuming, connected, no outage: what /readyz answers (503 while NATS or the
        store is away)."""
        return self.ready.is_set() and self._connected() and not self.kill_switch.paused

    def _server_state(self, state: str) -> None:
        """The NATS connection was lost or is back: the kill switch follows it."""
        if state == "reconnecting":
            self.kill_switch.open("server", "the NATS connection was lost; reconnecting")
        elif state == "connected":
            self.kill_switch.close("server")

    def _connected(self) -> bool:
        return self._conn is not None and self._conn.current_state() == "connected"

    async def _health(self) -> dict[str, Any]:
        if self._conn is None:
            return {"state": "connecting", "agents": [a.name for a in self.agents]}
        report = await self._conn.health()
        report["agents"] = [a.name for a in self.agents]
        return report

    async def _wait_ready(
        self, runs: list[asyncio.Task[None]], stop: asyncio.Future[Any], rounds: list[asyncio.Event]
    ) -> None:
        """Until every consumer pulls and every partitioned agent has claimed its first share,
        one fails to start (raised here), or ``stop``."""
        waits = [c.ready for c in self._consumers] + rounds
        for event, run in zip(waits, runs, strict=True):
            ready = asyncio.ensure_future(event.wait())
            done, _ = await asyncio.wait({ready, run, stop}, return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            if run in done:
                run.result()  # the consumer's own error, if it failed to start
                return
            if stop in done:
                return

    async def stop(self) -> None:
        """Graceful: stop fetching, let in-flight batches finish (or nak them), then return."""
        self._stopping.set()

    def install_signal_handlers(self) -> None:
        """SIGINT and SIGTERM call ``stop()``."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self._stopping.set)
