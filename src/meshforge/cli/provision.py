"""``meshforge provision``: create or update streams and consumers; ``--dry-run`` shows the plan."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

import typer

from meshforge.cli.common import NatsUrl, nats_target

if TYPE_CHECKING:
    from rich.table import Table

    from meshforge.config import Settings
    from meshforge.topology.provision import Plan
    from meshforge.topology.specs import ConsumerSpec, StreamSpec

__all__ = ["provision", "register"]

_STYLE = {"create": "green", "update": "yellow", "unchanged": "dim", "refused": "bold red"}


def register(app: typer.Typer) -> None:
    app.command("provision")(provision)


def _site_nodes(site: str | None, nodes: list[str]) -> list[tuple[str, str]]:
    """``--site lab1 --node node7``: the same two words as ``meshforge node SITE NODE``."""
    pairs = []
    for value in nodes:
        legacy_site, dot, legacy_node = value.partition(".")
        if dot and site is None and legacy_site and legacy_node and "." not in legacy_node:
            pairs.append((legacy_site, legacy_node))  # the older SITE.NODE spelling
            continue
        if site is None:
            raise typer.BadParameter(
                f"--node {value} needs its site: meshforge provision --site SITE --node {value}",
                param_hint="--site",
            )
        pairs.append((site, value))
    return pairs


def provision(
    nats_url: NatsUrl = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan; change nothing on the server.")
    ] = False,
    agent: Annotated[
        list[str] | None,
        typer.Option(
            "--agent", metavar="NAME", help="Also provision <NAME>_consumer (repeatable)."
        ),
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option("--tenant", help="The --agent consumers of workers bound to this tenant."),
    ] = None,
    namespace: Annotated[
        str | None,
        typer.Option(
            "--namespace", help="The --agent consumers of workers bound to this namespace."
        ),
    ] = None,
    site: Annotated[
        str | None, typer.Option("--site", metavar="SITE", help="The site of the --node names.")
    ] = None,
    node: Annotated[
        list[str] | None,
        typer.Option(
            "--node", metavar="NODE", help="Also provision node_<SITE>_<NODE> (repeatable)."
        ),
    ] = None,
    partitions: Annotated[
        int | None,
        typer.Option(
            "--partitions",
            metavar="N",
            min=0,
            max=1024,
            help="Partition each --agent's commands N ways (env MESHFORGE_PARTITIONS; 0: off).",
        ),
    ] = None,
) -> None:
    """Create or update the five MeshForge streams, and consumers for --agent / --node.

    Streams whose subjects overlap another stream's, or changes JetStream cannot make in
    place (retention, storage), are refused: the plan is printed and nothing is changed.

    With --partitions N (or MESHFORGE_PARTITIONS) each --agent gets N partition durables,
    one for unpartitioned subjects, and the ownership bucket MESHFORGE_PARTITIONS.

    Example: meshforge provision --agent order --agent inventory --site lab1 --node node7 --dry-run
    """
    from meshforge.config import load_settings
    from meshforge.topology.specs import (
        agent_consumer,
        default_streams,
        node_consumer,
        partition_consumers,
    )

    settings = load_settings({"nats_url": nats_url, "partitions": partitions})
    streams = default_streams(settings)
    if settings.partitions:
        # Partition durables (and the ownership bucket) instead of the one agent durable.
        consumers = [
            spec
            for name in agent or []
            for spec in partition_consumers(name, settings, tenant, namespace).values()
        ]
    else:
        consumers = [agent_consumer(name, settings, tenant, namespace) for name in agent or []]
    consumers += [node_consumer(s, n, settings) for s, n in _site_nodes(site, node or [])]
    with nats_target(settings.nats_url) as url:
        asyncio.run(_provision(url, settings, streams, consumers, dry_run))


async def _provision(
    url: str,
    settings: Settings,
    streams: list[StreamSpec],
    consumers: list[ConsumerSpec],
    dry_run: bool,
) -> None:
    from meshforge.cli.common import console as new_console
    from meshforge.topology.provision import apply, plan
    from meshforge.topology.subjects import STREAM_CONTROL
    from meshforge.transport.connection import connect

    console = new_console()
    async with await connect(settings, url=url, name="meshforge-provision") as conn:
        planned = await plan(conn.js, streams, consumers)
        console.print(_table(planned, "plan" if dry_run else "provisioning"))
        limit = settings.control_max_consumers
        console.print(
            f"node mailboxes: {STREAM_CONTROL} takes "
            f"{f'at most {limit}' if limit > 0 else 'any number of'} consumers, one per node "
            f"(control_max_consumers {limit})"
        )
        if planned.refused or not dry_run:
            report = await apply(conn.js, planned)  # raises, one line, when anything is refused
            console.print(
                f"applied {len(report.applied)} change(s)" if report.changed else "no changes"
            )
            if settings.partitions:
                from meshforge.topology.partitions import BUCKET, ensure_bucket

                await ensure_bucket(conn.js, settings)
                console.print(f"partition bucket {BUCKET}: lease {settings.partition_lease:g}s")
            if any(c.stream == STREAM_CONTROL for c in consumers):
                # Nodes announce themselves there; a node without API rights cannot make it.
                from meshforge.control.presence import NODES_BUCKET, nodes_bucket

                await nodes_bucket(conn.js, create=True, replicas=settings.replicas)
                console.print(f"presence bucket {NODES_BUCKET} ready")
        elif planned.has_changes:
            console.print(f"dry run: {len(planned.pending)} change(s) planned, nothing applied")
        else:
            console.print("no changes")


def _table(planned: Plan, title: str) -> Table:
    from rich.table import Table

    table = Table(title=f"MeshForge {title}", show_lines=False)
    table.add_column("kind")
    table.add_column("name", no_wrap=True)
    table.add_column("action")
    table.add_column("details", overflow="fold")
    for step in planned.steps:
        style = _STYLE[step.action.value]
        table.add_row(step.kind, step.name, f"[{style}]{step.action.value}[/]", step.details)
    return table
