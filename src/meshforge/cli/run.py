"""``meshforge run MODULE:AGENT [...]``: run agents until SIGINT/SIGTERM, with exactly-once effects."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Annotated, Any

import typer

from meshforge.cli.common import (
    MetricsHost,
    MetricsPort,
    NatsUrl,
    NoProvision,
    StoreUrl,
    nats_target,
)

if TYPE_CHECKING:
    from meshforge.config import Settings


def register(app: typer.Typer) -> None:
    app.command("run")(run)


def run(
    agents: Annotated[
        list[str],
        typer.Argument(metavar="MODULE:AGENT...", help="Agents to run, e.g. meshforge.demo:OrderAgent."),
    ],
    store: StoreUrl = None,
    no_provision: NoProvision = False,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    nats_url: NatsUrl = None,
) -> None:
    """Run one or more agents until SIGINT/SIGTERM.

    Shutdown is graceful: fetching stops, in-flight commands finish (or go back to the
    stream), nothing is lost.
    """
    from meshforge.config import load_settings
    from meshforge.observability import configure_logging
    from meshforge.runtime.worker import import_from_cwd, load_agent

    settings = load_settings(
        {
            "store_url": store,
            "nats_url": nats_url,
            "provision": False if no_provision else None,
            "metrics_port": metrics_port,
            "metrics_host": metrics_host,
        }
    )
    configure_logging(settings.log_level, settings.log_json)
    import_from_cwd()
    instances = [load_agent(spec) for spec in agents]
    with nats_target(settings.nats_url) as url:
        asyncio.run(_serve(instances, dataclasses.replace(settings, nats_url=url)))


async def _serve(agents: list[Any], settings: Settings) -> None:
    from meshforge.runtime.worker import Worker

    worker = Worker(agents, settings)
    worker.install_signal_handlers()
    await worker.run()
