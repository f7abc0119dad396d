"""``meshforge ctl send / reply / status / nodes``: commands to control-plane nodes, and what they report."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from meshforge.cli.common import NatsUrl, json_payload, nats_target

if TYPE_CHECKING:
    from meshforge.config import Settings
    from meshforge.control.fleet import Fleet
    from meshforge.control.reply import Reply

ctl_app = typer.Typer(
    name="ctl",
    help="Send commands to control-plane nodes and read their status.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    from meshforge.cli.jobs import job_app

    ctl_app.add_typer(job_app, name="job")
    app.add_typer(ctl_app, name="ctl")


@ctl_app.command("send")
def send(
    site: Annotated[str, typer.Argument(metavar="SITE", help="The node's site.")],
    name: Annotated[str, typer.Argument(metavar="NODE", help="The node's name.")],
    command: Annotated[
        str, typer.Argument(metavar="COMMAND", help="The command, e.g. echo, sleep, restart.")
    ],
    payload: Annotated[
        str | None, typer.Argument(metavar="JSON", help="The payload object.")
    ] = None,
    not_before: Annotated[
        str | None,
        typer.Option(
            "--not-before", help="Run no earlier than this: RFC 3339 time or a delay (30s, 5m)."
        ),
    ] = None,
    deadline: Annotated[
        str | None,
        typer.Option(
            "--deadline", help="Do not run after this: RFC 3339 time or a delay (30s, 5m)."
        ),
    ] = None,
    expect_epoch: Annotated[
        int | None, typer.Option("--expect-epoch", help="Run only if the node is at this epoch.")
    ] = None,
    wait: Annotated[
        float,
        typer.Option("--wait", min=0, help="Seconds to wait for the reply; 0 returns at once."),
    ] = 0,
    command_id: Annotated[
        str | None, typer.Option("--id", help="The command's id (a repeated id is not run again).")
    ] = None,
    nats_url: NatsUrl = None,
) -> None:
    """Drop a command into the node's mailbox; print its reply (with --wait) or that it is queued.

    Exits 1 when the reply's status is not ok (error, expired, rejected) or, with --wait,
    when no reply came in time."""
    from meshforge.config import load_settings
    from meshforge.control.client import to_timestamp

    body = json_payload(payload)
    # Times are fixed now, before connecting, so "30s" means 30 s from when it was typed.
    nb = to_timestamp(not_before, what="--not-before")
    dl = to_timestamp(deadline, what="--deadline")
    settings = load_settings({"nats_url": nats_url})
    with nats_target(settings.nats_url) as url:
        status = asyncio.run(
            _send(url, settings, site, name, command, body, nb, dl, expect_epoch, wait, command_id)
        )
    raise typer.Exit(status)


async def _send(
    url: str,
    settings: Settings,
    site: str,
    name: str,
    command: str,
    body: dict[str, Any],
    not_before: str | None,
    deadline: str | None,
    expect_epoch: int | None,
    wait: float,
    command_id: str | None,
) -> int:
    from meshforge.control.client import ControlClient
    from meshforge.topology.provision import ensure
    from meshforge.topology.specs import default_streams
    from meshforge.transport.connection import connect

    async with await connect(settings, url=url, name="meshforge-ctl") as conn:
        if settings.provision:
            await ensure(conn.js, default_streams(settings), [])
        ctl = ControlClient(conn, settings=settings)
        cid = await ctl.send(
            site, name, command, body,
            not_before=not_before, deadline=deadline, expect_epoch=expect_epoch, command_id=command_id,
        )  # fmt: skip
        if wait <= 0:
            typer.echo(f"queued {command} as {cid} in the mailbox of {site}.{name}")
            return 0
        reply = await ctl.wait_reply(site, name, cid, timeout=wait)
        if reply is None:
            typer.echo(
                f"error: queued {command} as {cid} in the mailbox of {site}.{name}, but no reply "
                f"within {wait:g}s; read it later with: meshforge ctl reply {site} {name} {cid}",
                err=True,
            )
            return 1
        typer.echo(json.dumps(reply.to_dict(), indent=2, default=str))
        return 0 if reply.ok else 1


@ctl_app.command("reply")
def reply(
    site: Annotated[str, typer.Argument(metavar="SITE", help="The node's site.")],
    name: Annotated[str, typer.Argument(metavar="NODE", help="The node's name.")],
    command_id: Annotated[
        str, typer.Argument(metavar="COMMAND_ID", help="The id ctl send printed.")
    ],
    wait: Annotated[
        float, typer.Option("--wait", min=0, help="Seconds to wait for a reply not there yet.")
    ] = 0,
    nats_url: NatsUrl = None,
) -> None:
    """Print the node's reply to an earlier command (exit 1 if it is not ok or none came yet)."""
    from meshforge.config import load_settings

    settings = load_settings({"nats_url": nats_url})
    with nats_target(settings.nats_url) as url:
        found = asyncio.run(_reply(url, settings, site, name, command_id, wait))
    if found is None:
        typer.echo(f"error: no reply to {command_id} from {site}.{name} yet", err=True)
        raise typer.Exit(1)
    typer.echo(json.dumps(found.to_dict(), indent=2, default=str))
    raise typer.Exit(0 if found.ok else 1)


async def _reply(
    url: str, settings: Settings, site: str, name: str, command_id: str, wait: float
) -> Reply | None:
    from meshforge.control.client import ControlClient
    from meshforge.transport.connection import connect

    async with await connect(settings, url=url, name="meshforge-ctl") as conn:
        # At least a moment, so the replies already stored are read through.
        timeout = max(wait, 2.0)
        return await ControlClient(conn, settings=settings).wait_reply(
            site, name, command_id, timeout
        )


@ctl_app.command("status")
def status(
    site: Annotated[str, typer.Argument(metavar="SITE", help="The node's site.")],
    name: Annotated[str, typer.Argument(metavar="NODE", help="The node's name.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    nats_url: NatsUrl = None,
) -> None:
    """Show the node's epoch, when it was last seen and how many commands wait in its mailbox."""
    from meshforge.config import load_settings

    settings = load_settings({"nats_url": nats_url})
    with nats_target(settings.nats_url) as url:
        report = asyncio.run(_status(url, settings, site, name))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    seen = report["last_seen"]
    if seen is None:
        seen_text = "never (the node has not announced itself)"
    else:
        state = (
            "stopped"
            if report["state"] == "stopped"
            else "alive"
            if report["alive"]
            else "not heard from lately"
        )
        seen_text = f"{seen} ({report['seconds_since_seen']:.1f}s ago, {state})"
    lines = [
        ("node", f"{site}.{name}"),
        ("epoch", "-" if report["epoch"] is None else str(report["epoch"])),
        ("version", report["version"] or "-"),
        ("started", report["started_at"] or "-"),
        ("last seen", seen_text),
        ("mailbox", f"{report['mailbox_depth']} command(s) waiting"),
    ]
    for label, value in lines:
        typer.echo(f"{label:<10} {value}")


async def _status(url: str, settings: Settings, site: str, name: str) -> dict[str, Any]:
    from meshforge.control.client import ControlClient
    from meshforge.transport.connection import connect

    async with await connect(settings, url=url, name="meshforge-ctl") as conn:
        return (await ControlClient(conn, settings=settings).status(site, name)).to_dict()


@ctl_app.command("nodes")
def nodes(
    site: Annotated[str | None, typer.Option("--site", help="Only this site's nodes.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    nats_url: NatsUrl = None,
) -> None:
    """List every node the presence data knows: alive / late / gone, epoch, version,
    last seen and mailbox depth; first "N announced, M mailboxes" (a node with a mailbox
    that never announced shows in the difference)."""
    from meshforge.config import load_settings

    settings = load_settings({"nats_url": nats_url})
    with nats_target(settings.nats_url) as url:
        fleet = asyncio.run(_nodes(url, settings, site))
    if as_json:
        typer.echo(json.dumps(fleet.to_dict(), indent=2))
        return
    typer.echo(fleet.summary())
    if not fleet.rows:
        typer.echo("no node has announced itself" + (f" at site {site}" if site else ""))
        return
    header = ("NODE", "STATE", "EPOCH", "VERSION", "LAST SEEN", "AGO", "MAILBOX")
    lines = [header]
    for row in fleet.rows:
        r = row.to_dict()
        seen = f"{r['seconds_since_seen']:.1f}s"
        version = r["version"] or "-"
        lines.append(
            (f"{r['site']}.{r['node']}", r["liveness"], str(r["epoch"]), version,
             r["last_seen"], seen, str(r["mailbox_depth"]))
        )  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())


async def _nodes(url: str, settings: Settings, site: str | None) -> Fleet:
    from meshforge.control.fleet import survey
    from meshforge.transport.connection import connect

    async with await connect(settings, url=url, name="meshforge-ctl") as conn:
        return await survey(conn.js, site)
