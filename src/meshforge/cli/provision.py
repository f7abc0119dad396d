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


def _site_node(value: str) -> tuple[str, str]:
    site, dot, node = value.partition(".")
    if not dot or not site or not node or "." in node:
        raise typer.BadParameter(
            f"expected SITE.NODE such as lab1.node7, got {value!r}", param_hint="--node"
        )
    return site, node


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
    node: Annotated[
        list[str] | None,
        typer.Option(
            "--node", metavar="SITE.NODE", help="Also provision node_<SITE>_<NODE> (repeatable)."
        ),
    ] = None,
) -> None:
    """Create or update the five MeshForge streams, and consumers for --agent / --node.

    Streams whose subjects overlap another stream's, or changes JetStream cannot make in
    place (retention, storage), are refused: the plan is printed and nothing is changed.

    Example: meshforge provision --agent order --agent inventory --node lab1.node7 --dry-run
    """
    from meshforge.config import load_settings
    from meshforge.topology import agent_consumer, default_streams, node_consumer

    settings = load_settings({"nats_url": nats_url})
    streams = default_streams(settings)
    consumers = [agent_consumer(name, settings) for name in agent or []]
    consumers += [node_consumer(*_site_node(value), settings) for value in node or []]
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
