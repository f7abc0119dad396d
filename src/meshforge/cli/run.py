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
    service_settings,
)

if TYPE_CHECKING:
    from meshforge.config import Settings


def register(app: typer.Typer) -> None:
    app.command("run")(run)


def run(
    agents: Annotated[
        list[str],
        typer.Argument(
            metavar="MODULE:AGENT...", help="Agents to run, e.g. meshforge.demo:OrderAgent."
        ),
    ],
    store: StoreUrl = None,
    no_provision: NoProvision = False,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    nats_url: NatsUrl = None,
    push: Annotated[
        bool,
        typer.Option("--push", help="Take commands from push consumers (needs --deliver-group)."),
    ] = False,
    deliver_group: Annotated[
        str | None,
        typer.Option(
            "--deliver-group",
            metavar="NAME",
            help="With --push: workers of one group share each agent's commands.",
        ),
    ] = None,
    relay: Annotated[
        bool,
        typer.Option("--relay", help="Also publish the store's outbox (as `meshforge relay`)."),
    ] = False,
    log_level: Annotated[
        str | None,
        typer.Option(
            "--log-level",
            metavar="LEVEL",
            help="debug, info (a summary of what was handled, once a second at most), warning, error"
            " (env MESHFORGE_LOG_LEVEL).",
        ),
    ] = None,
    partitions: Annotated[
        int | None,
        typer.Option(
            "--partitions",
            metavar="N",
            min=0,
            max=1024,
            help="Split each agent's commands N ways by resource (env MESHFORGE_PARTITIONS; 0: off).",
        ),
    ] = None,
) -> None:
    """Run one or more agents until SIGINT/SIGTERM.

    Shutdown is graceful: fetching stops, in-flight commands finish (or go back to the
    stream), nothing is lost.
    """
    from meshforge.ops.observability import configure_logging
    from meshforge.runtime.worker import freeze_start_up_heap, import_from_cwd, load_agent

    settings = service_settings(
        store=store, nats_url=nats_url, no_provision=no_provision, metrics_port=metrics_port,
        metrics_host=metrics_host, partitions=partitions, log_level=log_level,
    )  # fmt: skip
    if settings.partitions and push:
        raise typer.BadParameter(
            "partitions need pull consumers: drop --push", param_hint="--partitions"
        )
    if push != (deliver_group is not None):
        raise typer.BadParameter("--push and --deliver-group NAME go together", param_hint="--push")
    if deliver_group is not None:
        from meshforge.errors import InvalidSubject
        from meshforge.topology.subjects import validate_token

        try:
            validate_token(deliver_group, "deliver group")
        except InvalidSubject as exc:
            raise typer.BadParameter(str(exc), param_hint="--deliver-group") from None
    configure_logging(settings.log_level, settings.log_json)
    import_from_cwd()
    instances = [load_agent(spec) for spec in agents]
    with nats_target(settings.nats_url) as url:
        target = dataclasses.replace(settings, nats_url=url)
        freeze_start_up_heap()
        asyncio.run(_serve(instances, target, deliver_group=deliver_group, relay=relay))


async def _serve(
    agents: list[Any], settings: Settings, *, deliver_group: str | None, relay: bool
) -> None:
    from meshforge.runtime.worker import Worker

    store = None
    if relay:
        from meshforge.store import open_store

        # One store for the agents and the relay beside them.
        store = await asyncio.to_thread(open_store, settings.store_url)
    try:
        worker = Worker(agents, settings, store=store, deliver_group=deliver_group)
        worker.install_signal_handlers()
        if store is None:
            await worker.run()
            return
        from meshforge.cli.relay import run_relay

        stop = asyncio.Event()

        async def relay_then_stop() -> None:
            try:
                await run_relay(store, settings, stop, metrics=worker.metrics)
            finally:  # a relay that fails stops the agents too: the process exits with its error
                await worker.stop()

        relaying = asyncio.create_task(relay_then_stop())
        try:
            await worker.run()
        finally:
            stop.set()
            await relaying
    finally:
        if store is not None:
            await asyncio.to_thread(store.close)
