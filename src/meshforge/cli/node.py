"""``meshforge node SITE NODE [MODULE:NODE]``: run a control-plane node until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Annotated, Any

import typer

from meshforge.cli.common import (
    MetricsHost,
    MetricsPort,
    NatsUrl,
    NoProvision,
    StoreUrl,
    nats_target,
    service_settings,
)

if TYPE_CHECKING:
    from meshforge.config import Settings
    from meshforge.control.node import Node

DEFAULT_NODE = "meshforge.demo:DemoNode"
log = logging.getLogger("meshforge.node")


def register(app: typer.Typer) -> None:
    app.command("node")(node)


def node(
    site: Annotated[str, typer.Argument(metavar="SITE", help="The node's site, e.g. lab1.")],
    name: Annotated[str, typer.Argument(metavar="NODE", help="The node's name, e.g. node7.")],
    spec: Annotated[
        str, typer.Argument(metavar="MODULE:NODE", help="The Node class to run.")
    ] = DEFAULT_NODE,
    store: StoreUrl = None,
    presence_interval: Annotated[
        float, typer.Option(min=0.1, help="Seconds between presence announcements.")
    ] = 10.0,
    no_provision: NoProvision = False,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    nats_url: NatsUrl = None,
) -> None:
    """Run a node: pull its mailbox control.cmd.SITE.NODE, run each command once, reply on
    control.reply.SITE.NODE. Its epoch (a boot counter in the store) goes up by one per start."""
    from meshforge.control.node import load_node
    from meshforge.ops.observability import configure_logging
    from meshforge.topology.subjects import validate_token

    validate_token(site, "site")
    validate_token(name, "node")
    settings = service_settings(
        store=store, nats_url=nats_url, no_provision=no_provision, metrics_port=metrics_port,
        metrics_host=metrics_host,
    )  # fmt: skip
    configure_logging(settings.log_level, settings.log_json)
    instance = load_node(spec)
    with nats_target(settings.nats_url) as url:
        asyncio.run(_serve(instance, site, name, url, settings, presence_interval))


async def _serve(
    instance: Node, site: str, name: str, url: str, settings: Settings, presence_interval: float
) -> None:
    from meshforge.control.runtime import NodeRuntime
    from meshforge.ops.observability import Metrics, serve_http
    from meshforge.store import open_store
    from meshforge.transport.connection import connect

    metrics = Metrics()
    started: list[NodeRuntime] = []

    async def health() -> dict[str, Any]:
        return (
            await started[0].health()
            if started
            else {"state": "connecting", "site": site, "node": name}
        )

    endpoint = None
    if settings.metrics_port is not None:
        # Before connecting, so a port in use fails at once; /readyz is 503 until pulling.
        endpoint = await serve_http(
            settings.metrics_host, settings.metrics_port, metrics, health,
            lambda: bool(started) and started[0].is_ready(),
        )  # fmt: skip
        log.info("metrics on %s:%d", endpoint.host, endpoint.port)
    store = await asyncio.to_thread(open_store, settings.store_url)
    try:
        conn = await connect(settings, url=url, name=f"meshforge-node-{site}.{name}")
        async with conn:
            runtime = NodeRuntime(
                instance,
                site,
                name,
                conn,
                store,
                settings=settings,
                presence_interval=presence_interval,
                metrics=metrics,
            )
            started.append(runtime)
            runtime.install_signal_handlers()
            await runtime.run()
    finally:
        await asyncio.to_thread(store.close)
        if endpoint is not None:
            await endpoint.close()
