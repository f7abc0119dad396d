"""``meshforge permissions ROLE...``: print the nats-server ``authorization`` block for roles."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["permissions", "register"]


def register(app: typer.Typer) -> None:
    app.command("permissions")(permissions)


def permissions(
    roles: Annotated[
        list[str],
        typer.Argument(metavar="ROLE...", help="admin, agent, node, publisher, spark or leaf."),
    ],
    agent: Annotated[
        list[str] | None,
        typer.Option(
            "--agent", metavar="NAME", help="agent: the agents the worker runs (repeatable)."
        ),
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option("--tenant", help="agent, publisher: only this tenant's subjects."),
    ] = None,
    namespace: Annotated[
        str | None,
        typer.Option("--namespace", help="agent, publisher: only this namespace's subjects."),
    ] = None,
    site: Annotated[
        str | None,
        typer.Option("--site", help="node: the nodes' site; leaf: the site whose link logs in."),
    ] = None,
    node: Annotated[
        list[str] | None,
        typer.Option("--node", metavar="NODE", help="node: the nodes (repeatable)."),
    ] = None,
    stream: Annotated[
        list[str] | None,
        typer.Option(
            "--stream",
            help="spark: streams it reads (repeatable; default MESHFORGE_EVENTS, MESHFORGE_FAILED).",
        ),
    ] = None,
    subject: Annotated[
        list[str] | None,
        typer.Option(
            "--subject",
            help="publisher: what it may publish (repeatable; default the tenant's commands; name events here).",
        ),
    ] = None,
    write: Annotated[
        list[str] | None,
        typer.Option(
            "--write", metavar="SUBJECT", help="spark: subjects it publishes to (repeatable)."
        ),
    ] = None,
    user: Annotated[
        str | None,
        typer.Option("--user", help="The user name (one role only; default meshforge-ROLE)."),
    ] = None,
    inbox_prefix: Annotated[
        str | None,
        typer.Option(
            "--inbox-prefix",
            help="The reply-inbox prefix the user's clients are given (MESHFORGE_INBOX_PREFIX; "
            "one role only; default _INBOX_<user>).",
        ),
    ] = None,
) -> None:
    """Print a nats-server `authorization` block: one least-privilege user per ROLE.

    Passwords are not printed: each user's is the variable $<USER>_PASSWORD (upper case,
    - and . as _), which nats-server reads from its environment (or put a bcrypt hash there).
    Start workers and nodes with --no-provision and provision as admin. Each user may
    subscribe only to its own reply inbox, _INBOX_<user>.>: MeshForge clients connected as
    that user use it (users authenticated by token, NKey or credentials file: set
    MESHFORGE_INBOX_PREFIX and pass the same --inbox-prefix here).

    Example: meshforge permissions admin agent node --agent order --site lab1 --node node7
    """
    from meshforge.config import load_settings
    from meshforge.errors import ConfigError
    from meshforge.topology.permissions import (
        ROLES,
        User,
        authorization_block,
        leaf_block,
        role_grant,
    )

    unknown = [r for r in roles if r not in (*ROLES, "leaf")]
    if unknown:
        raise typer.BadParameter(f"unknown role {unknown[0]!r}; roles: {', '.join(ROLES)}, leaf")
    leaf = "leaf" in roles
    roles = [r for r in roles if r != "leaf"]
    if leaf and site is None:
        raise ConfigError("permissions leaf: give --site SITE (the site whose leaf link logs in)")
    if user is not None and len(roles) != 1:
        raise typer.BadParameter(
            "--user names one user: give exactly one ROLE", param_hint="--user"
        )
    if inbox_prefix is not None and len(roles) != 1:
        raise typer.BadParameter(
            "--inbox-prefix is one user's: give exactly one ROLE", param_hint="--inbox-prefix"
        )
    settings = load_settings()
    users = [
        User(
            user or f"meshforge-{role}",
            role_grant(
                role,
                settings,
                agents=agent or [],
                tenant=tenant,
                namespace=namespace,
                site=site,
                nodes=node or [],
                streams=stream or [],
                subjects=subject or [],
                writes=write or [],
            ),
            inbox_prefix=inbox_prefix,
        )
        for role in dict.fromkeys(roles)
    ]
    if users:
        typer.echo(authorization_block(users), nl=False)
    if leaf and site is not None:
        typer.echo(
            "# the hub: put this block inside leafnodes { } (meshforge server --leaf-users FILE)"
        )
        typer.echo(leaf_block([site]), nl=False)
        typer.echo(f"# site {site}: MESHFORGE_LEAF_USER=meshforge-leaf-{site} MESHFORGE_LEAF_PASSWORD=... "
                   f"meshforge server --leaf HUB_URL --domain {site}")  # fmt: skip
