"""``meshforge provision``: create or update streams and consumers; ``--dry-run`` shows the plan."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

import typer

from meshforge.cli.common import NatsUrl, nats_target

if TYPE_CHECKING:
    from rich.table import Table

    from meshforge.config import Settings
    from meshforge.provision import Plan
    from meshforge.topology import ConsumerSpec, StreamSpec

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
    site: Annotated[
        str | None, typer.Option("--site", metavar="SITE", help="The site of the --node names.")
    ] = None,
    node: Annotated[
        list[str] | None,
        typer.Option(
            "--node", metavar="NODE", help="Also provision node_<SITE>_<NODE> (repeatable)."
        ),
    ] = None,
) -> None:
    """Create or update the five MeshForge streams, and consumers for --agent / --node.

    Streams whose subjects overlap another stream's, or changes JetStream cannot make in
    place (retention, storage), are refused: the plan is printed and nothing is changed.

    Example: meshforge provision --agent order --agent inventory --site lab1 --node node7 --dry-run
    """
    from meshforge.config import load_settings
    from meshforge.topology import agent_consumer, default_streams, node_consumer

    settings = load_settings({"nats_url": nats_url})
    streams = default_streams(settings)
    consumers = [agent_consumer(name, settings) for name in agent or []]
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
    from rich.console import Console

    from meshforge.connection import connect
    from meshforge.provision import apply, plan

    console = Console()
    async with await connect(settings, url=url, name="meshforge-provision") as conn:
        planned = await plan(conn.js, streams, consumers)
        console.print(_table(planned, "plan" if dry_run else "provisioning"))
        if planned.refused or not dry_run:
            report = await apply(conn.js, planned)  # raises, one line, when anything is refused
            console.print(
                f"applied {len(report.applied)} change(s)" if report.changed else "no changes"
            )
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
