"""``meshforge relay``: publish the transactional outbox of a store until SIGINT/SIGTERM.

Applications write messages into the outbox inside their own store transaction
(``meshforge.publish.outbox.enqueue``); this command is the process that sends them. Several
relays may run against one store (rows are leased).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from meshforge.cli.common import MetricsHost, MetricsPort, NatsUrl, StoreUrl, nats_target

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from meshforge.config import Settings
    from meshforge.ops.observability import Metrics
    from meshforge.publish.outbox import OutboxRelay
    from meshforge.store.base import Store
    from meshforge.transport.connection import Connection

log = logging.getLogger("meshforge.relay")


def register(app: typer.Typer) -> None:
    app.command("relay")(relay)


def relay(
    store: StoreUrl = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, help="Rows claimed and published per batch.")
    ] = 100,
    idle: Annotated[
        float,
        typer.Option(
            "--idle", min=0.05, help="Longest pause (s) between polls of an empty outbox."
        ),
    ] = 1.0,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    nats_url: NatsUrl = None,
) -> None:
    """Publish the store's outbox until SIGINT/SIGTERM (rows sent once each, in id order)."""
    from meshforge.config import load_settings
    from meshforge.ops.observability import configure_logging
    from meshforge.store import open_store

    settings = load_settings(
        {
            "store_url": store,
            "nats_url": nats_url,
            "metrics_port": metrics_port,
            "metrics_host": metrics_host,
        }
    )
    configure_logging(settings.log_level, settings.log_json)
    opened = open_store(settings.store_url)
    try:
        with nats_target(settings.nats_url) as url:
            settings = dataclasses.replace(settings, nats_url=url)
            asyncio.run(_relay_until_signal(opened, settings, batch_size=batch_size, idle=idle))
    finally:
        opened.close()


async def run_relay(
    store: Store,
    settings: Settings,
    stop: asyncio.Event,
    *,
    batch_size: int = 100,
    idle: float = 1.0,
    metrics: Metrics | None = None,
    on_connect: Callable[[Connection], None] | None = None,
) -> int:
    """Run an ``OutboxRelay`` on its own connection until ``stop`` is set; returns rows sent.

    ``metrics``: where it counts (e.g. the worker's, so its endpoint shows the outbox depth);
    ``on_connect`` is given the connection once it is up (for health)."""
    from meshforge.publish.outbox import OutboxRelay
    from meshforge.publish.publisher import Publisher
    from meshforge.transport.connection import connect

    async with await connect(settings, name="meshforge-relay") as conn:
        if on_connect is not None:
            on_connect(conn)
        await _streams(conn.js, settings)
        outbox: OutboxRelay = OutboxRelay(
            store, Publisher(conn.js, settings, metrics), batch_size=batch_size, idle=idle
        )
        task = asyncio.create_task(outbox.run())
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        await outbox.stop(settings.shutdown_timeout)
        await task  # the relay's own error, if it failed
        return outbox.sent_total


async def _streams(js: JetStreamContext, settings: Settings) -> None:
    """Create the CONTRACT streams when allowed, so the first rows have somewhere to go."""
    if not settings.provision:
        return
    from meshforge.topology.provision import ensure
    from meshforge.topology.specs import default_streams

    await ensure(js, default_streams(settings), [])


async def _relay_until_signal(
    store: Store, settings: Settings, *, batch_size: int, idle: float
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    from meshforge.ops.observability import Metrics, serve_http

    metrics = Metrics()
    conns: list[Connection] = []

    async def health() -> dict[str, Any]:
        return await conns[0].health() if conns else {"state": "connecting"}

    endpoint = None
    if settings.metrics_port is not None:
        # Before connecting, so a port in use fails at once with one line.
        endpoint = await serve_http(
            settings.metrics_host, settings.metrics_port, metrics, health,
            lambda: bool(conns) and conns[0].current_state() == "connected",
        )  # fmt: skip
        log.info("metrics on %s:%d", endpoint.host, endpoint.port)
    try:
        sent = await run_relay(
            store,
            settings,
            stop,
            batch_size=batch_size,
            idle=idle,
            metrics=metrics,
            on_connect=conns.append,
        )
    finally:
        if endpoint is not None:
            await endpoint.close()
    typer.secho(f"outbox relay stopped: {sent} message(s) sent", err=True, dim=True)
