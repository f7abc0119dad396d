"""``meshforge holds ls / release``: resources whose later commands wait for an earlier one."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from meshforge.cli.common import StoreUrl

holds_app = typer.Typer(
    help="Resources whose later commands wait for an earlier one (per-resource order).",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(holds_app, name="holds")


@holds_app.command("ls")
def ls(
    store: StoreUrl = None,
    agent: Annotated[str | None, typer.Option(help="One agent's holds only.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object a line.")] = False,
) -> None:
    """List held resources, oldest first: how many commands wait, and for how long.

    A resource "stopped by" a key waits for that dead-lettered command (an agent with
    ``hold_after_dead_letter``): re-drive it (``meshforge dlq redrive``) or release the
    resource (``meshforge holds release``).
    """
    from meshforge.config import load_settings
    from meshforge.runtime.engine import consumer_name
    from meshforge.runtime.holds import list_holds
    from meshforge.store import open_existing_store
    from meshforge.topology.subjects import validate_token

    settings = load_settings({"store_url": store})
    consumer = consumer_name(validate_token(agent, "agent name")) if agent else None
    opened = open_existing_store(settings.store_url)
    try:
        views = opened.run(lambda tx: list_holds(tx, consumer))
    finally:
        opened.close()
    now = time.time()
    if as_json:
        for v in views:
            typer.echo(json.dumps({
                "consumer": v.consumer, "tenant": v.scope.tenant, "namespace": v.scope.namespace,
                "resource": v.resource, "held": v.held, "held_deliveries": v.deliveries,
                "age_seconds": round(now - v.since, 3), "stopped_by": v.stopped_by,
            }))  # fmt: skip
        return
    if not views:
        typer.echo("no held resources")
        return
    typer.echo(
        f"{'consumer':<24} {'tenant/namespace':<24} {'resource':<24} {'held':>5} {'age':>8}  stopped by"
    )
    for v in views:
        scope = f"{v.scope.tenant}/{v.scope.namespace}"
        typer.echo(
            f"{v.consumer:<24} {scope:<24} {v.resource:<24} {v.held:>5} {now - v.since:>7.0f}s  {v.stopped_by or '-'}"
        )


@holds_app.command("release")
def release(
    agent: Annotated[str, typer.Argument(metavar="AGENT", help="The agent's name.")],
    resource: Annotated[str, typer.Argument(metavar="RESOURCE", help="The resource id.")],
    store: StoreUrl = None,
    tenant: Annotated[str, typer.Option(help="The resource's tenant.")] = "default",
    namespace: Annotated[str, typer.Option(help="The resource's namespace.")] = "default",
) -> None:
    """Let a resource stopped behind a dead-lettered command go on without it (its workers
    see the release within 5 s). Exit 1 when it was not stopped."""
    from meshforge.config import load_settings
    from meshforge.errors import MeshForgeError
    from meshforge.runtime.engine import consumer_name
    from meshforge.runtime.holds import release as release_resource
    from meshforge.store import open_existing_store
    from meshforge.topology.scope import Scope
    from meshforge.topology.subjects import validate_token

    settings = load_settings({"store_url": store})
    consumer = consumer_name(validate_token(agent, "agent name"))
    scope = Scope(validate_token(tenant, "tenant"), validate_token(namespace, "namespace"))
    opened = open_existing_store(settings.store_url)
    try:
        released = opened.run(lambda tx: release_resource(tx, consumer, scope, resource))
    finally:
        opened.close()
    if not released:
        raise MeshForgeError(
            f"{agent} {scope.tenant}/{scope.namespace}/{resource} is not held behind a dead letter"
        )
    typer.echo(f"released {agent} {scope.tenant}/{scope.namespace}/{resource}")
