"""The data pipeline: ``ingest`` a stream into Parquet, ``audit`` exactly-once, ``replay`` rows.

Example::

    spark = spark_session("local[2]")
    ingest(spark, url, "MESHFORGE_EVENTS", "out/events")
    ingest(spark, url, "MESHFORGE_FAILED", "out/failed")
    result = audit(spark, "out/events", "out/report", failed="out/failed",
                   store_url="sqlite:///.meshforge/store.db")
    print(result.ok, result.html_path)
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from meshforge.deadletters.originals import ORIGINAL_PREFIX
from meshforge.errors import ConfigError
from meshforge.spark.audit import StoreTables, compute
from meshforge.spark.report import write_report
from meshforge.topology.subjects import DEAD_LETTER_PREFIX

__all__ = [
    "AuditResult",
    "IngestResult",
    "ReplayResult",
    "audit",
    "ingest",
    "replay",
    "spark_session",
]

log = logging.getLogger("meshforge.spark")

# (done, total or None, note): how the pipelines report progress while they run
Progress = Callable[[int, int | None, str], None]


def spark_session(
    master: str | None = None,
    *,
    app_name: str = "meshforge-pipeline",
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A SparkSession with MeshForge's sources registered.

    ``master`` defaults to ``local[*]``, except under ``spark-submit``, whose master wins.
    Executors run this interpreter unless ``PYSPARK_PYTHON`` says otherwise.
    """
    import meshforge.spark

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # launched by spark-submit
    if master or not submitted:
        builder = builder.master(master or "local[*]")
    local = not submitted and (master or "local").startswith("local")
    if local:
        # Local mode talks to itself only: keep the driver on loopback, not the host's address.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings = {
        **(
            {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}
            if local
            else {}
        ),
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "8",
        **(conf or {}),
    }
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    meshforge.spark.register(spark)
    return spark


def _reader_options(servers: str, stream: str, options: Mapping[str, str] | None) -> dict[str, str]:
    return {"servers": servers, "stream": stream, **(options or {})}


# --- ingest ------------------------------------------------------------------------


@dataclass(frozen=True)
class IngestResult:
    """What one ``ingest`` run landed."""

    stream: str
    output: str
    rows: int
    batches: int
    end_offset: dict[str, int] | None


def ingest(
    spark: SparkSession,
    servers: str,
    stream: str,
    output: str | Path,
    checkpoint: str | Path | None = None,
    *,
    options: Mapping[str, str] | None = None,
    max_messages_per_trigger: int | None = None,
    progress: Progress | None = None,
) -> IngestResult:
    """Land every message of ``stream`` not landed yet into Parquet at ``output``.

    Partitioned by ``date`` (of the stored time) and envelope ``type``; the checkpoint
    (default ``<output>/_checkpoint``) makes it resumable and, with Spark's file sink,
    exactly once however often it is stopped and started again.
    """
    from meshforge.spark.nats_sync import ConnOptions, SyncNats

    output = str(output)
    checkpoint = str(checkpoint or Path(output) / "_checkpoint")
    with SyncNats(ConnOptions.from_options(_reader_options(servers, stream, options))) as client:
        client.stream_info(stream)  # a missing stream is one clear line, not a Spark trace
    read_opts = {
        "startingOffsets": "earliest",
        "envelope": "true",
        **_reader_options(servers, stream, options),
    }
    if max_messages_per_trigger:
        read_opts["maxMessagesPerTrigger"] = str(max_messages_per_trigger)
    df = spark.readStream.format("jetstream").options(**read_opts).load()
    df = df.withColumn("date", F.date_format("ts", "yyyy-MM-dd"))
    query = (
        df.writeStream.format("parquet")
        .option("checkpointLocation", checkpoint)
        .partitionBy("date", "type")
        .trigger(availableNow=True)
        .queryName(f"meshforge_ingest_{stream}_{int(time.time() * 1000)}")
        .start(output)
    )
    rows = batches = 0
    seen: set[int] = set()
    try:
        while True:
            finished = query.awaitTermination(1)
            for p in query.recentProgress:
                if p["batchId"] not in seen:
                    seen.add(p["batchId"])
                    rows += int(p["numInputRows"])
                    batches += 1 if p["numInputRows"] else 0
            if progress is not None:
                progress(rows, _pending(query, rows), f"{stream}: {batches} micro-batches")
            if finished:
                break
    except BaseException:
        query.stop()
        raise
    exc = query.exception()
    if exc is not None:
        raise ConfigError(f"ingest of {stream} failed: {str(exc).splitlines()[0]}")
    end = _end_offset(query)
    log.info("ingest %s: %d rows in %d micro-batches into %s", stream, rows, batches, output)
    return IngestResult(stream=stream, output=output, rows=rows, batches=batches, end_offset=end)


def _pending(query: Any, rows: int) -> int | None:
    """Total rows this run will land, from the source's latest and start offsets."""
    recent = query.recentProgress
    if not recent:
        return None
    import json

    try:
        first = recent[0]["sources"][0]
        start = json.loads(first["startOffset"]) if first.get("startOffset") else None
        latest = json.loads(recent[-1]["sources"][0]["latestOffset"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    if not isinstance(latest, dict) or not latest:
        return None
    begin = next(iter(start.values())) if isinstance(start, dict) and start else 1
    return max(rows, int(next(iter(latest.values()))) - int(begin))


def _end_offset(query: Any) -> dict[str, int] | None:
    import json

    for p in reversed(query.recentProgress):
        try:
            end = json.loads(p["sources"][0]["endOffset"])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if isinstance(end, dict):
            return {str(k): int(v) for k, v in end.items()}
    return None


# --- audit -------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditResult:
    """The audit's verdict, its findings and where the report went."""

    ok: bool
    findings: dict[str, Any]
    json_path: Path
    html_path: Path


def _table(
    spark: SparkSession, source: str | DataFrame | None, servers: str | None, what: str
) -> DataFrame | None:
    """A Parquet path, a DataFrame, or (with ``servers``) a stream name read in batch."""
    if source is None or isinstance(source, DataFrame):
        return source
    if Path(source).exists():
        return spark.read.parquet(source)
    if servers and source.replace("_", "").isalnum():
        return (
            spark.read.format("jetstream")
            .options(servers=servers, stream=source, envelope="true")
            .load()
        )
    raise ConfigError(
        f"audit: {what} {source!r} is neither a Parquet table nor (with servers) a stream"
    )


def audit(
    spark: SparkSession,
    events: str | DataFrame,
    output_dir: str | Path,
    *,
    failed: str | DataFrame | None = None,
    store_url: str | None = None,
    commands: str | DataFrame | None = None,
    servers: str | None = None,
    progress: Progress | None = None,
) -> AuditResult:
    """Prove or disprove exactly-once over what landed; write ``audit.json`` and ``audit.html``.

    ``events``/``failed``/``commands`` are Parquet tables written by :func:`ingest` (or
    DataFrames, or with ``servers`` stream names read directly); ``store_url`` is the
    runtime's store, read through the ``meshforge_store`` source.
    """
    steps = 4

    def step(i: int, note: str) -> None:
        if progress is not None:
            progress(i, steps, note)

    step(0, "loading tables")
    events_df = _table(spark, events, servers, "events")
    assert events_df is not None
    failed_df = _table(spark, failed, servers, "failed")
    commands_df = _table(spark, commands, servers, "commands")
    if store_url:
        from meshforge.spark.store_source import check_options

        check_options({"url": store_url, "table": "effects"})  # a missing store: one line, here
    store = StoreTables.load(spark, store_url) if store_url else None
    step(1, "computing findings")
    findings = compute(spark, events_df, failed=failed_df, store=store, commands=commands_df)
    findings["inputs"] = {
        "events": events if isinstance(events, str) else "DataFrame",
        "failed": failed if isinstance(failed, str) or failed is None else "DataFrame",
        "store": store_url,
        "commands": commands if isinstance(commands, str) or commands is None else "DataFrame",
    }
    step(3, "writing the report")
    json_path, html_path = write_report(findings, output_dir)
    step(4, "done")
    return AuditResult(
        ok=bool(findings["ok"]), findings=findings, json_path=json_path, html_path=html_path
    )


# --- replay ------------------------------------------------------------------------


@dataclass
class ReplayResult:
    """What a replay published (or, dry, would publish)."""

    rows: int = 0
    stored: int = 0
    duplicates: int = 0
    dry_run: bool = False
    sample: list[dict[str, Any]] = field(default_factory=list)


def _replay_rows(df: DataFrame) -> Iterator[dict[str, Any]]:
    for row in df.toLocalIterator(prefetchPartitions=True):
        yield row.asDict()


def _undo_dead_letters(df: DataFrame) -> DataFrame:
    """Rows of the dead-letter stream go back to their original subject, without Dlq-* headers.

    Published to their own ``failed.`` subject they would only become dead letters again.
    """
    if "subject" not in df.columns:
        return df
    df = df.where(~F.col("subject").startswith(ORIGINAL_PREFIX))  # copies, reached via their letter
    failed = F.col("subject").startswith(DEAD_LETTER_PREFIX)
    stripped = F.expr(f"substring(subject, {len(DEAD_LETTER_PREFIX) + 1})")
    if "headers" in df.columns:
        original = F.coalesce(F.col("headers").getItem("Dlq-Original-Subject"), stripped)
        kept = F.map_filter("headers", lambda k, _v: ~k.startswith("Dlq-"))
        df = df.withColumn("headers", F.when(failed, kept).otherwise(F.col("headers")))
    else:
        original = stripped
    return df.withColumn("subject", F.when(failed, original).otherwise(F.col("subject")))


def replay(
    spark: SparkSession,
    table: str | DataFrame,
    subject: str | None,
    servers: str | None,
    *,
    dry_run: bool = False,
    rate: float | None = None,
    where: str | None = None,
    limit: int | None = None,
    options: Mapping[str, str] | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """Publish the rows of ``table`` to ``subject`` (else each row's own), in stored order.

    Without ``subject``, a dead letter goes to its original subject, not back to ``failed.``.

    Ids are the rows' ``id`` (the envelope id) or derived from subject and body, so a
    replay run twice stores nothing twice inside the duplicate window. Rows go through
    the driver, in ``seq`` order, at most ``rate`` per second.
    """
    from meshforge.spark.nats_sync import ConnOptions, SyncNats
    from meshforge.spark.writer import PublishReport, WriteOptions, outgoing, publish_window

    df = spark.read.parquet(table) if isinstance(table, str) else table
    if where:
        df = df.where(where)
    if subject is None:
        df = _undo_dead_letters(df)
    order = [c for c in ("stream", "seq") if c in df.columns]
    if order:
        df = df.orderBy(*order)
    if limit:
        df = df.limit(limit)
    opts = WriteOptions.from_options(
        {**(options or {}), **({"subject": subject} if subject else {})}, df.schema
    )
    total = df.count()
    result = ReplayResult(dry_run=dry_run)
    if progress is not None:
        progress(0, total, "dry run" if dry_run else "publishing")
    keys = opts.key_columns

    def to_message(row: dict[str, Any]) -> Any:
        subj = row.get(opts.subject_column) if opts.subject_column else None
        headers = row.get(opts.headers_column) if opts.headers_column else None
        msg_id = row.get(opts.msg_id_column) if opts.msg_id_column else None
        return outgoing(
            opts, subj, row.get(opts.data_column), headers, msg_id, [row.get(k) for k in keys]
        )

    if dry_run:
        for row in _replay_rows(df):
            message = to_message(row)
            result.rows += 1
            if len(result.sample) < 10:
                result.sample.append(
                    {
                        "subject": message.subject,
                        "msg_id": message.msg_id,
                        "bytes": len(message.data),
                    }
                )
            if progress is not None and result.rows % 1000 == 0:
                progress(result.rows, total, "dry run")
        if progress is not None:
            progress(result.rows, total, "dry run")
        return result
    if not servers:
        raise ConfigError("replay: a NATS URL is required unless --dry-run")
    conn = ConnOptions.from_options({"servers": servers, **(options or {})})
    report = PublishReport()
    window: list[Any] = []
    started = time.monotonic()
    size = opts.max_in_flight if not rate else max(1, min(opts.max_in_flight, int(rate // 10) or 1))
    with SyncNats(conn) as client:

        def flush() -> None:
            client.run(publish_window(client, window, opts, report))
            report.rows += len(window)
            window.clear()
            if rate:
                ahead = report.rows / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)  # the rate limit
            if progress is not None:
                progress(report.rows, total, "publishing")

        for row in _replay_rows(df):
            window.append(to_message(row))
            if len(window) >= size:
                flush()
        if window:
            flush()
    result.rows, result.stored, result.duplicates = report.rows, report.stored, report.duplicates
    log.info(
        "replay: %d rows, %d stored, %d duplicates", result.rows, result.stored, result.duplicates
    )
    return result
