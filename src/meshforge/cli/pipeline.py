"""``meshforge pipeline ingest | audit | replay``: the Spark data pipeline.

Spark runs in local mode (``--master local[*]``) unless ``--master`` names a cluster or
the command runs under ``spark-submit`` (see docs/PIPELINE.md). Tables live under
``--output`` (default ``./.meshforge/pipeline``): ``events/``, ``failed/``, ``report/``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from meshforge.cli.common import HOME, NatsUrl, nats_target
from meshforge.errors import ConfigError, MissingTopology
from meshforge.transport.credentials import redact_url

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from meshforge.config import Settings
    from meshforge.spark.pipelines import Progress

DEFAULT_STREAMS = ("MESHFORGE_EVENTS", "MESHFORGE_FAILED")
_REDACT = r"(?i)secret|password|token|seed|access[.]?key"

Master = Annotated[
    str | None,
    typer.Option(
        "--master",
        help="Spark master, e.g. local[2] or spark://host:7077 (default local[*]).",
        show_default=False,
    ),
]
Conf = Annotated[
    list[str] | None,
    typer.Option("--conf", help="Extra Spark setting KEY=VALUE; repeatable.", show_default=False),
]
Output = Annotated[
    Path, typer.Option("--output", "-o", help="Directory of the pipeline's tables and report.")
]


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        name="pipeline",
        help="The Spark data pipeline: ingest, audit, replay.",
        no_args_is_help=True,
    )
    group.command("ingest")(ingest)
    group.command("audit")(audit)
    group.command("replay")(replay)
    app.add_typer(group, name="pipeline")


def table_name(stream: str) -> str:
    """``MESHFORGE_EVENTS`` -> ``events``: the directory a stream lands in."""
    low = stream.lower()
    return low.removeprefix("meshforge_") or low


def _session(master: str | None, conf: list[str] | None) -> SparkSession:
    from meshforge.spark.pipelines import spark_session

    # Spark shows options in plans and logs; hide every secret option MeshForge passes
    settings: dict[str, str] = {"spark.ui.enabled": "false", "spark.redaction.regex": _REDACT}
    for item in conf or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--conf expects KEY=VALUE, got {item!r}")
        settings[key.strip()] = value.strip()
    spark = spark_session(master, conf=settings)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def source_options(settings: Settings) -> dict[str, str]:
    """The data source's auth and TLS options from MeshForge's settings."""
    pairs = {
        "user": settings.user, "password": settings.password, "token": settings.token,
        "creds": settings.creds_file, "nkey_seed": settings.nkey_seed,
        "nkey_seed_file": settings.nkey_seed_file, "tls_ca": settings.tls_ca,
        "tls_cert": settings.tls_cert, "tls_key": settings.tls_key,
        "inbox_prefix": settings.inbox_prefix,
        "connect_timeout": f"{settings.connect_timeout:g}",
        "connect_attempts": str(settings.connect_attempts),
    }  # fmt: skip
    return {k: v for k, v in pairs.items() if v is not None}


@contextlib.contextmanager
def _progress(label: str) -> Iterator[Progress]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"), TimeElapsedColumn(), transient=False,
    ) as bar:  # fmt: skip
        task = bar.add_task(label, total=None, note="")

        def update(done: int, total: int | None, note: str) -> None:
            bar.update(task, completed=done, total=total, note=note)

        yield update


def _stream_exists(url: str, stream: str, options: dict[str, str]) -> bool:
    from meshforge.spark.nats_sync import ConnOptions, SyncNats

    with SyncNats(ConnOptions.from_options({"servers": url, **options})) as client:
        try:
            client.stream_info(stream)
        except MissingTopology:
            return False
    return True


def ingest(
    nats_url: NatsUrl = None,
    stream: Annotated[
        list[str] | None,
        typer.Option(
            "--stream",
            "-s",
            help="Stream to land; repeatable (default MESHFORGE_EVENTS and MESHFORGE_FAILED).",
            show_default=False,
        ),
    ] = None,
    output: Output = HOME / "pipeline",
    max_per_trigger: Annotated[
        int | None,
        typer.Option(
            "--max-per-trigger", help="At most this many messages per micro-batch.", min=1
        ),
    ] = None,
    master: Master = None,
    conf: Conf = None,
) -> None:
    """Land streams in Parquet tables (by date and type), exactly once and resumable."""
    from meshforge.config import load_settings
    from meshforge.spark.pipelines import ingest as run_ingest

    settings = load_settings({"nats_url": nats_url})
    options = source_options(settings)
    streams = list(stream or DEFAULT_STREAMS)
    with nats_target(settings.nats_url) as url:
        wanted = []
        for name in streams:
            if _stream_exists(url, name, options):
                wanted.append(name)
            elif stream:
                raise MissingTopology(f"stream {name!r} not found on {redact_url(url)}")
            else:
                typer.secho(f"skipping {name}: no such stream yet", err=True, dim=True)
        spark = _session(master, conf)
        for name in wanted:
            target = output / table_name(name)
            with _progress(f"ingest {name}") as progress:
                result = run_ingest(
                    spark, url, name, target, options=options,
                    max_messages_per_trigger=max_per_trigger, progress=progress,
                )  # fmt: skip
            typer.echo(
                f"{name}: {result.rows} new rows in {result.batches} micro-batches -> {target}"
            )


def audit(
    output: Output = HOME / "pipeline",
    events: Annotated[
        Path | None, typer.Option("--events", help="Landed events (default OUTPUT/events).")
    ] = None,
    failed: Annotated[
        Path | None, typer.Option("--failed", help="Landed dead letters (default OUTPUT/failed).")
    ] = None,
    commands: Annotated[
        Path | None, typer.Option("--commands", help="Landed commands, if any.")
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(
            "--store",
            envvar="MESHFORGE_STORE_URL",
            help="The runtime's store URL (default: the local SQLite store if present).",
            show_default=False,
        ),
    ] = None,
    report: Annotated[
        Path | None, typer.Option("--report", help="Report directory (default OUTPUT/report).")
    ] = None,
    master: Master = None,
    conf: Conf = None,
) -> None:
    """Prove or disprove exactly-once over what landed; write audit.json and audit.html.

    Exits 1 when a duplicate effect, a command without an effect or a lost output is found.
    """
    from meshforge.config import load_settings
    from meshforge.spark.pipelines import audit as run_audit

    events = events or output / "events"
    if not events.exists():
        raise ConfigError(f"no events table at {events}: run 'meshforge pipeline ingest' first")
    failed = failed or (output / "failed")
    store_url = store or load_settings().store_url
    if store_url.startswith("sqlite:///") and not Path(store_url[len("sqlite:///") :]).exists():
        if store:
            raise ConfigError(f"no store at {store_url}")
        store_url = ""
    spark = _session(master, conf)
    with _progress("audit") as progress:
        result = run_audit(
            spark, str(events), report or output / "report",
            failed=str(failed) if failed.exists() else None, store_url=store_url or None,
            commands=str(commands) if commands else None, progress=progress,
        )  # fmt: skip
    print_summary(result.findings)
    typer.echo(f"report: {result.html_path}")
    if not result.ok:
        typer.secho("exactly-once VIOLATED (see the report)", err=True, fg=typer.colors.RED)
        raise typer.Exit(1)
    typer.secho("exactly-once holds", fg=typer.colors.GREEN)


def print_summary(findings: dict[str, object]) -> None:
    from rich.table import Table

    from meshforge.cli.common import console as new_console

    counts = findings.get("counts", {})
    latency = findings.get("latency_ms", {})
    dead = findings.get("dead_letters", {})
    assert isinstance(counts, dict) and isinstance(latency, dict) and isinstance(dead, dict)
    table = Table(title="audit", show_header=False)
    rows = [
        ("events", counts.get("events")), ("effects in the store", counts.get("effects")),
        ("commands landed", counts.get("commands")),
        ("duplicate effects", counts.get("duplicate_effects")), ("doubled outputs", counts.get("doubled_outputs")),
        ("missing effects", counts.get("missing_effects")),
        ("lost outputs", counts.get("lost_outputs")), ("dead letters", dead.get("total")),
        ("latency p50 / p99 ms", f"{latency.get('p50', '-')} / {latency.get('p99', '-')}"),
    ]  # fmt: skip
    for name, value in rows:
        table.add_row(name, "-" if value is None else str(value))
    new_console().print(table)


def replay(
    table: Annotated[
        str,
        typer.Argument(help="A Parquet table: a path, or a name under OUTPUT (events, failed)."),
    ],
    subject: Annotated[
        str | None,
        typer.Option("--subject", help="Publish every row here (default: each row's own subject)."),
    ] = None,
    nats_url: NatsUrl = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would be published; publish nothing.")
    ] = False,
    rate: Annotated[
        float | None,
        typer.Option("--rate", help="At most this many messages per second.", min=0.001),
    ] = None,
    where: Annotated[
        str | None,
        typer.Option("--where", help="Spark SQL filter, e.g. \"type = 'order.created'\"."),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", help="At most this many rows.", min=1)
    ] = None,
    output: Output = HOME / "pipeline",
    master: Master = None,
    conf: Conf = None,
) -> None:
    """Publish rows of a table back into a subject, with deterministic ids."""
    from meshforge.config import load_settings
    from meshforge.spark.pipelines import replay as run_replay

    path = Path(table)
    if not path.exists() and (output / table).exists():
        path = output / table
    if not path.exists():
        raise ConfigError(f"no table at {table} (nor {output / table})")
    if subject:
        from meshforge.topology.subjects import validate_subject

        validate_subject(subject)
    settings = load_settings({"nats_url": nats_url})
    spark = _session(master, conf)
    with contextlib.ExitStack() as stack:
        url = None if dry_run else stack.enter_context(nats_target(settings.nats_url))
        progress = stack.enter_context(_progress("replay (dry run)" if dry_run else "replay"))
        result = run_replay(
            spark, str(path), subject, url, dry_run=dry_run, rate=rate, where=where, limit=limit,
            options=source_options(settings), progress=progress,
        )  # fmt: skip
    if dry_run:
        for item in result.sample:
            typer.echo(
                f"would publish {item['subject']} id={item['msg_id']} ({item['bytes']} bytes)"
            )
        typer.echo(f"dry run: {result.rows} rows would be published")
    else:
        typer.echo(
            f"replayed {result.rows} rows: {result.stored} stored, {result.duplicates} duplicates"
        )
