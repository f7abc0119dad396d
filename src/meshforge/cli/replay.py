"""``meshforge replay AGENT``: rebuild an agent's state from its event log and print the state hash."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

from meshforge.cli.common import StoreUrl

if TYPE_CHECKING:
    from meshforge.store import Store
    from meshforge.topology.scope import Scope


def register(app: typer.Typer) -> None:
    app.command("replay")(replay)


def replay(
    agent: Annotated[
        str,
        typer.Argument(
            metavar="AGENT",
            help="The agent's name (hash its events) or MODULE:AGENT (also rebuild its state"
            " and compare it with the stored snapshots).",
        ),
    ],
    store: StoreUrl = None,
    tenant: Annotated[
        str | None, typer.Option(help="Replay one tenant's log only (with --namespace).")
    ] = None,
    namespace: Annotated[
        str | None, typer.Option(help="The namespace of --tenant's log (default: default).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Print an agent's event count and state hash, rebuilt from its event log.

    The state hash is SHA-256 over a canonical encoding of the events. With MODULE:AGENT
    the events are also folded into state and compared with the stored snapshots (the
    snapshot hash, stored and replayed); a mismatch exits 1. Every tenant's and
    namespace's log is replayed unless --tenant (and --namespace) name one; when several
    are replayed, resources outside the default scope show as ``tenant/namespace/id``.
    """
    from meshforge.config import load_settings
    from meshforge.runtime.agent import Agent
    from meshforge.runtime.replay import replay as run_replay
    from meshforge.runtime.worker import import_from_cwd, load_agent
    from meshforge.store import open_existing_store
    from meshforge.topology.scope import Scope
    from meshforge.topology.subjects import validate_token

    import_from_cwd()
    instance: Agent[object] | None = load_agent(agent) if ":" in agent else None
    name = instance.name if instance is not None else validate_token(agent, "agent name")
    settings = load_settings({"store_url": store})
    scope = None
    if tenant is not None or namespace is not None:
        scope = Scope(
            validate_token(tenant or "default", "tenant"),
            validate_token(namespace or "default", "namespace"),
        )
    opened = open_existing_store(settings.store_url)
    try:
        _require_log(opened, name, scope, known_agent=instance is not None)
        result = run_replay(opened, name, instance, scope=scope)
    finally:
        opened.close()
    if as_json:
        out = {
            "agent": result.agent,
            "events": result.events,
            "resources": result.resources,
            "state_hash": result.state_hash,
            "snapshot_hash": result.snapshot_hash,
            "stored_hash": result.stored_hash,
            "mismatched": list(result.mismatched),
        }
        typer.echo(json.dumps(out))
    else:
        typer.echo(
            f"agent {result.agent}: {result.events} events over {result.resources} resources"
        )
        typer.echo(f"state hash: sha256:{result.state_hash}")
        if instance is not None:
            typer.echo(f"snapshot hash, stored: sha256:{result.stored_hash}")
            typer.echo(f"snapshot hash, replayed: sha256:{result.snapshot_hash}")
            if result.consistent:
                typer.echo(
                    f"snapshots: {result.resources} rebuilt from events, all equal to the stored state"
                )
            else:
                shown = ", ".join(result.mismatched[:5])
                typer.echo(
                    f"snapshots: {len(result.mismatched)} differ from the stored state: {shown}"
                )
    if not result.consistent:
        raise typer.Exit(1)


def _require_log(store: Store, agent: str, scope: Scope | None, *, known_agent: bool) -> None:
    """A misspelt agent or tenant is an error naming what the store has, not "0 events"."""
    from meshforge.errors import ConfigError

    logs = store.logs()
    if any(a == agent and (scope is None or s == scope) for s, a in logs):
        return
    if known_agent and scope is None:
        return  # a real agent that has not stored an event yet
    have = ", ".join(sorted({a for _, a in logs})) or "none"
    if scope is not None and any(a == agent for _, a in logs):
        scopes = ", ".join(str(s) for s, a in logs if a == agent)
        raise ConfigError(f"agent {agent!r} has no events for {scope}; it has events for {scopes}")
    raise ConfigError(f"no events of agent {agent!r} in the store; agents with events: {have}")
