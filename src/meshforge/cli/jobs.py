"""``meshforge ctl job create / run / status / ls / cancel``: roll one command out to many nodes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from meshforge.cli.common import MetricsHost, MetricsPort, NatsUrl, nats_target

if TYPE_CHECKING:
    from meshforge.config import Settings
    from meshforge.control.jobs import JobSpec
    from meshforge.transport.connection import Connection

job_app = typer.Typer(
    name="job",
    help="Jobs: one command rolled out to many nodes, at a rate, with retries and cancel.",
    no_args_is_help=True,
)

JobName = Annotated[str, typer.Argument(metavar="JOB", help="The job's name (a token).")]


def _targets(sites: list[str], nodes: list[str], nodes_file: Path | None) -> list[str]:
    named = list(nodes)
    if nodes_file is not None:
        try:
            text = nodes_file.read_text()
        except OSError as exc:
            raise typer.BadParameter(str(exc), param_hint="--nodes-file") from None
        named += [line.split("#")[0].strip() for line in text.splitlines()]
    out = []
    for item in filter(None, named):
        site, sep, node = item.replace(".", "/", 1).partition("/")
        if not sep or not site or not node:
            raise typer.BadParameter(f"expected SITE/NODE, got {item!r}", param_hint="--node")
        out.append(f"{site}/{node}")
    if not out and not sites:
        raise typer.BadParameter("name the targets: --site, --node or --nodes-file")
    return out


@job_app.command("create")
def create(
    job: JobName,
    command: Annotated[str, typer.Option("--command", help="The command each node runs.")],
    payload: Annotated[str, typer.Option("--payload", help="The payload, a JSON object.")] = "{}",
    site: Annotated[
        list[str] | None, typer.Option("--site", help="Every node of this site (presence data).")
    ] = None,
    node: Annotated[
        list[str] | None, typer.Option("--node", help="SITE/NODE (repeatable).")
    ] = None,
    nodes_file: Annotated[
        Path | None, typer.Option("--nodes-file", help="A file of SITE/NODE lines.")
    ] = None,
    rate: Annotated[
        float | None, typer.Option("--rate", min=0.001, help="Commands per minute.")
    ] = None,
    abort_after: Annotated[
        float | None,
        typer.Option(
            "--abort-after",
            min=0.001,
            max=100,
            help="Stop sending when this percent of the done nodes failed.",
        ),
    ] = None,
    min_done: Annotated[
        int, typer.Option("--min-done", min=1, help="Done nodes before --abort-after is judged.")
    ] = 1,
    deadline: Annotated[
        str | None, typer.Option("--deadline", help="Not run after: RFC 3339 or a delay (10m).")
    ] = None,
    not_before: Annotated[
        str | None, typer.Option("--not-before", help="Not run before: RFC 3339 or a delay.")
    ] = None,
    retries: Annotated[
        int, typer.Option("--retries", min=0, help="Re-sends after FAILED or TIMED_OUT.")
    ] = 0,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout", min=0.001, help="Seconds an attempt may go unanswered (TIMED_OUT)."
        ),
    ] = None,
    detach: Annotated[
        bool, typer.Option("--detach", help="Store the job only; drive it with `ctl job run`.")
    ] = False,
    nats_url: NatsUrl = None,
) -> None:
    """Create a job and drive it to its end (exit 1 unless every node SUCCEEDED).

    Its state lives in JetStream: if this process dies, `meshforge ctl job run JOB` goes on."""
    from meshforge.cli.common import json_payload
    from meshforge.config import load_settings
    from meshforge.control.client import to_timestamp

    body = json_payload(payload)
    named = _targets(site or [], node or [], nodes_file)
    options = {
        "rate": rate, "abort_after": abort_after, "min_done": min_done, "retries": retries,
        "timeout": timeout, "deadline": to_timestamp(deadline, what="--deadline"),
        "not_before": to_timestamp(not_before, what="--not-before"),
    }  # fmt: skip
    settings = load_settings({"nats_url": nats_url})
    with nats_target(settings.nats_url) as url:
        code = asyncio.run(
            _create(url, settings, job, command, body, site or [], named, options, detach)
        )
    raise typer.Exit(code)


async def _connect(url: str, settings: Settings) -> Connection:
    from meshforge.transport.connection import connect

    return await connect(settings, url=url, name="meshforge-ctl")


async def _create(
    url: str, settings: Settings, job: str, command: str, body: dict[str, Any],
    sites: list[str], named: list[str], options: dict[str, Any], detach: bool,
) -> int:  # fmt: skip
    from meshforge.control.jobs import JobSpec, JobStore
    from meshforge.topology.provision import ensure
    from meshforge.topology.specs import default_streams

    async with await _connect(url, settings) as conn:
        if settings.provision:
            await ensure(conn.js, default_streams(settings), [])
        targets = [tuple(n.split("/", 1)) for n in named]
        for site in sites:
            targets += await _site_targets(conn, site)
        unique = list(dict.fromkeys((s, n) for s, n in targets))
        spec = JobSpec(job, command, body, targets=unique, **options)
        store = await JobStore.open(conn.js)
        await store.create(spec)
        typer.echo(f"job {job}: {command} to {len(unique)} node(s)")
        if detach:
            return 0
        return await _drive(conn, store, spec, settings)


async def _site_targets(conn: Connection, site: str) -> list[tuple[str, str]]:
    """The nodes of ``site`` that announced themselves; refused (one line) when that list
    can be incomplete: the listing could not be read to its end (``IncompleteListing``), or
    the control stream is at its consumer limit, so nodes past it never started."""
    from meshforge.control.fleet import survey
    from meshforge.errors import ConfigError, MeshForgeError

    fleet = await survey(conn.js, site)
    if fleet.mailboxes.full:
        raise MeshForgeError(
            f"--site {site}: the node list can be incomplete: {fleet.summary()}, and nodes "
            "past the limit never started; raise control_max_consumers "
            "(MESHFORGE_CONTROL_MAX_CONSUMERS) and run `meshforge provision`, or name the nodes"
        )
    if not fleet.rows:
        raise ConfigError(f"--site {site}: no node of this site has announced itself")
    return [(row.site, row.node) for row in fleet.rows]


async def _drive(conn: Connection, store: Any, spec: JobSpec, settings: Settings) -> int:
    from meshforge.control.rollout import JobController, job_report
    from meshforge.ops.observability import Metrics, serve_http

    metrics = Metrics()
    endpoint = None
    if settings.metrics_port is not None:

        async def health() -> dict[str, Any]:
            return await conn.health()

        endpoint = await serve_http(
            settings.metrics_host, settings.metrics_port, metrics, health,
            lambda: conn.current_state() == "connected",
        )  # fmt: skip
        typer.echo(f"metrics on http://{endpoint.host}:{endpoint.port}/metrics", err=True)
    try:
        final = await JobController(conn, store, spec.job, metrics=metrics).run()
    finally:
        if endpoint is not None:
            await endpoint.close()
    report = await job_report(store, spec.job)
    _print_report(report)
    return 0 if final == "completed" and report["counts"]["SUCCEEDED"] == len(spec.targets) else 1


@job_app.command("run")
def run(
    job: JobName,
    nats_url: NatsUrl = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
) -> None:
    """Drive a job (again) until every node is done: after `create --detach`, or a controller
    that died. Exit 1 unless every node SUCCEEDED."""
    from meshforge.config import load_settings

    settings = load_settings(
        {"nats_url": nats_url, "metrics_port": metrics_port, "metrics_host": metrics_host}
    )
    with nats_target(settings.nats_url) as url:
        raise typer.Exit(asyncio.run(_run(url, settings, job)))


async def _run(url: str, settings: Settings, job: str) -> int:
    from meshforge.control.jobs import JobStore

    async with await _connect(url, settings) as conn:
        store = await JobStore.open(conn.js, create=False)
        return await _drive(conn, store, await store.spec(job), settings)


def _print_report(report: dict[str, Any]) -> None:
    counts = " ".join(f"{s}={n}" for s, n in report["counts"].items() if n)
    reason = f" ({report['reason']})" if report["reason"] else ""
    typer.echo(
        f"job {report['job']}: {report['status']}{reason}; {report['command']} to {report['targets']} node(s)"
    )
    typer.echo(f"  {counts}")
    for row in report["nodes"]:
        error = f"  {row['error']}" if row["error"] else ""
        name = f"{row['site']}.{row['node']}"
        typer.echo(f"  {name:<24} {row['state']:<12} attempt {row['attempt']}{error}")


@job_app.command("status")
def status(job: JobName, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
           nats_url: NatsUrl = None) -> None:  # fmt: skip
    """The job's status, its count per state and every node's state."""
    from meshforge.config import load_settings
    from meshforge.control.jobs import JobStore

    async def read(url: str, settings: Settings) -> dict[str, Any]:
        from meshforge.control.rollout import job_report

        async with await _connect(url, settings) as conn:
            return await job_report(await JobStore.open(conn.js, create=False), job)

    settings = load_settings({"nats_url": nats_url})
    with nats_target(settings.nats_url) as url:
        report = asyncio.run(read(url, settings))
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)


@job_app.command("ls")
def ls(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
       nats_url: NatsUrl = None) -> None:  # fmt: skip
    """Every job: status, command, targets, counts."""
    from meshforge.config import load_settings
    from meshforge.control.jobs import JobStore

    async def read(url: str, settings: Settings) -> list[dict[str, Any]]:
        from meshforge.control.rollout import job_report

        async with await _connect(url, settings) as conn:
            store = await JobStore.open(conn.js)
            out = []
            for spec in await store.jobs():
                report = await job_report(store, spec.job)
                report.pop("nodes")
                out.append(report)
            return out

    settings = load_settings({"nats_url": nats_url})
    with nats_target(settings.nats_url) as url:
        rows = asyncio.run(read(url, settings))
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        typer.echo("no jobs")
    for row in rows:
        counts = " ".join(f"{s}={n}" for s, n in row["counts"].items() if n)
        typer.echo(
            f"{row['job']:<20} {row['status']:<10} {row['command']:<12} {row['created_at']}  {counts}"
        )


@job_app.command("cancel")
def cancel(job: JobName, nats_url: NatsUrl = None) -> None:
    """Cancel a job: nothing more is sent, and nodes answer CANCELED to its commands not yet run."""
    from meshforge.config import load_settings
    from meshforge.control.jobs import JobStore

    async def do(url: str, settings: Settings) -> None:
        async with await _connect(url, settings) as conn:
            await (await JobStore.open(conn.js, create=False)).cancel(job)

    settings = load_settings({"nats_url": nats_url})
    with nats_target(settings.nats_url) as url:
        asyncio.run(do(url, settings))
    typer.echo(
        f"job {job} canceled: unsent commands will not be sent; nodes answer CANCELED to the rest"
    )
