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
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from meshforge.config import Settings, load_settings
from meshforge.connection import Connection, connect
from meshforge.consumer import Consumer
from meshforge.deadletter import REASONS
from meshforge.decisions import Decision, Delivery, Handler
from meshforge.errors import ConfigError, one_line
from meshforge.observability import HttpEndpoint, Metrics, serve_http
from meshforge.probes import DEFAULT_PROBE_INTERVAL, Probes
from meshforge.publisher import Publisher
from meshforge.runtime.agent import Agent
from meshforge.runtime.engine import Engine
from meshforge.store import open_store
from meshforge.store.base import Store
from meshforge.subjects import STREAM_COMMANDS, STREAM_EVENTS, STREAM_FAILED
from meshforge.topology import agent_consumer, default_streams, ensure, verify

__all__ = ["Worker", "import_from_cwd", "load_agent"]

log = logging.getLogger("meshforge.worker")
_AGENT_STREAMS = (STREAM_COMMANDS, STREAM_EVENTS, STREAM_FAILED)


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
        raise ConfigError(f"agent {spec!r}: cannot import {module_name!r}: {one_line(exc)}") from exc
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
        self._engines: list[Engine[Any]] = []
        self._stopping = asyncio.Event()
        self._conn: Connection | None = None
        self._endpoint: HttpEndpoint | None = None
        self._probes: asyncio.Task[None] | None = None
        self.metrics.track(self.is_ready, self._connected)

    async def run(self) -> None:
        """Connect, provision (unless disabled), consume until ``stop()``, then clean up.

        ``stop()`` (or a signal) while starting ends the start where it is: a worker that
        cannot reach its server, or waits on it, still stops when told.
        """
        settings = self.settings
        stop = asyncio.ensure_future(self._stopping.wait())
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
            await self._wait_ready(runs, stop)
            if not stop.done():
                self.ready.set()
                log.info("running %s", ", ".join(a.name for a in self.agents))
            await asyncio.wait([*runs, stop], return_when=asyncio.FIRST_COMPLETED)
            await asyncio.gather(*(c.stop(settings.shutdown_timeout) for c in self._consumers))
            results = await asyncio.gather(*runs, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                    raise result
        finally:
            stop.cancel()
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
            self._store = await asyncio.to_thread(open_store, settings.store_url)
        self._conn = conn = await connect(settings, name=f"meshforge-{'-'.join(a.name for a in self.agents)}")
        specs = [agent_consumer(a.name, settings) for a in self.agents]
        # A push consumer is made by its Consumer (it needs the deliver group): streams only.
        pulled = [] if self.deliver_group else specs
        if settings.provision:
            await ensure(conn.js, default_streams(settings), pulled)
        else:
            # Least privilege: only what agents use must exist (not the control plane's).
            needed = [s for s in default_streams(settings) if s.name in _AGENT_STREAMS]
            await verify(conn.js, needed, pulled)
        publisher = Publisher(conn.js, settings, self.metrics)
        for spec in specs:
            self.metrics.prepare_consumer(spec.durable, REASONS)
        for agent, spec in zip(self.agents, specs, strict=True):
            engine = Engine(agent, self._store, publisher, settings=settings, metrics=self.metrics)
            self._engines.append(engine)
            if self.deliver_group:
                consumer = Consumer(
                    conn, spec, handler=_one_by_one(engine), settings=settings, mode="push",
                    deliver_group=self.deliver_group, metrics=self.metrics, publisher=publisher,
                    provision=settings.provision,
                )  # fmt: skip
            else:
                consumer = Consumer(
                    conn, spec, batch_handler=engine.handle, settings=settings,
                    metrics=self.metrics, publisher=publisher, provision=False,
                )  # fmt: skip
            self._consumers.append(consumer)
        probes = Probes(conn.js, self.metrics, [(s.stream, s.durable) for s in specs], store=self._store)
        self._probes = asyncio.create_task(probes.run(self.probe_interval))

    @property
    def endpoint(self) -> HttpEndpoint | None:
        """The running /healthz /readyz /metrics endpoint (None without a metrics port)."""
        return self._endpoint

    def is_ready(self) -> bool:
        """Consuming and connected: what /readyz answers (503 while NATS is away)."""
        return self.ready.is_set() and self._connected()

    def _connected(self) -> bool:
        return self._conn is not None and self._conn.current_state() == "connected"

    async def _health(self) -> dict[str, Any]:
        if self._conn is None:
            return {"state": "connecting", "agents": [a.name for a in self.agents]}
        report = await self._conn.health()
        report["agents"] = [a.name for a in self.agents]
        return report

    async def _wait_ready(self, runs: list[asyncio.Task[None]], stop: asyncio.Future[Any]) -> None:
        """Until every consumer pulls, one fails to start (raised here), or ``stop``."""
        for consumer, run in zip(self._consumers, runs, strict=True):
            ready = asyncio.ensure_future(consumer.ready.wait())
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
