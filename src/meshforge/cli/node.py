"""``meshforge node SITE NODE [MODULE:NODE]``: run a control-plane node until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

import typer

from meshforge.cli.common import NatsUrl, StoreUrl, nats_target

if TYPE_CHECKING:
    from meshforge.config import Settings
    from meshforge.control.node import Node

DEFAULT_NODE = "meshforge.demo:DemoNode"


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
    nats_url: NatsUrl = None,
) -> None:
    """Run a node: pull its mailbox control.cmd.SITE.NODE, run each command once, reply on
    control.reply.SITE.NODE. Its epoch (a boot counter in the store) goes up by one per start."""
    from meshforge.config import load_settings
    from meshforge.control.node import load_node
    from meshforge.observability import configure_logging
    from meshforge.subjects import validate_token

    validate_token(site, "site")
    validate_token(name, "node")
    settings = load_settings({"store_url": store, "nats_url": nats_url})
    configure_logging(settings.log_level, settings.log_json)
    instance = load_node(spec)
    with nats_target(settings.nats_url) as url:
        asyncio.run(_serve(instance, site, name, url, settings, presence_interval))


async def _serve(
    instance: Node, site: str, name: str, url: str, settings: Settings, presence_interval: float
) -> None:
    from meshforge.connection import connect
    from meshforge.control.runtime import NodeRuntime
    from meshforge.store import open_store

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
            )
            runtime.install_signal_handlers()
            await runtime.run()
    finally:
        await asyncio.to_thread(store.close)
