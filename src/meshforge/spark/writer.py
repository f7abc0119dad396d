"""The ``jetstream`` sink: each row published with a deterministic ``Nats-Msg-Id``.

A row goes to the ``subject`` option when set, else to its ``subject`` column. Its body
is the ``data`` column (binary or string), else ``payload`` (string); ``headers`` (a
map) become NATS headers. The message id comes from the ``msgIdColumn`` option, else
a ``msg_id`` or ``id`` column, else it is derived from the row (UUIDv5 over subject,
body and the ``keyColumns``), so a retried task or a re-run job is deduplicated by the
server inside the stream's duplicate window.

Other options: ``maxInFlight`` (256), ``rate`` (messages per second per task, 0 = no
limit), ``publishAttempts`` (5), ``publishTimeout`` (seconds, 5), ``reportPath`` (a
driver-side file that gets one JSON line of counts per committed job or micro-batch).

Example::

    (df.write.format("jetstream").mode("append")
       .option("servers", url).option("subject", "evt.default.demo.order.replayed")
       .save())
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, MapType, StringType, StructType

from meshforge.errors import ConfigError, PublishError, one_line
from meshforge.spark.nats_sync import ConnOptions, SyncNats, lower_keys
from meshforge.topology.subjects import validate_subject
from meshforge.transport.sizes import SizeLimits, check_fits

__all__ = [
    "JetStreamStreamWriter",
    "JetStreamWriter",
    "PublishReport",
    "WriteOptions",
    "derive_msg_id",
    "outgoing",
    "publish_window",
]

log = logging.getLogger("meshforge.spark")

# Ids of rows without one are UUIDv5 in this namespace (distinct from envelope ids).
_ROW_NAMESPACE = uuid.UUID("6d657368-666f-7267-6500-00000000000a")


def derive_msg_id(subject: str, data: bytes, key: Sequence[Any] = ()) -> str:
    """The deterministic message id of a row without one."""
    digest = hashlib.sha256(data).hexdigest()
    extra = json.dumps(list(key), default=str, separators=(",", ":")) if key else ""
    return str(uuid.uuid5(_ROW_NAMESPACE, f"{subject}\n{digest}\n{extra}"))


@dataclass
class PublishReport(WriterCommitMessage):
    """What one task published: rows seen, messages stored, duplicates the server dropped."""

    rows: int = 0
    stored: int = 0
    duplicates: int = 0


@dataclass(frozen=True, slots=True)
class _Outgoing:
    subject: str
    data: bytes
    headers: dict[str, str]
    msg_id: str


@dataclass(frozen=True, slots=True)
class WriteOptions:
    subject: str | None
    subject_column: str | None
    data_column: str
    headers_column: str | None
    msg_id_column: str | None
    key_columns: tuple[str, ...]
    max_in_flight: int
    rate: float
    attempts: int
    timeout: float
    report_path: str | None

    @classmethod
    def from_options(cls, options: Mapping[str, str], schema: StructType) -> WriteOptions:
        options = lower_keys(options)
        names = set(schema.fieldNames())

        def number(name: str, default: float) -> float:
            raw = options.get(name.lower())
            try:
                return float(raw) if raw not in (None, "") else default
            except ValueError:
                raise ConfigError(
                    f"jetstream sink: option {name!r} must be a number, got {raw!r}"
                ) from None

        subject = options.get("subject") or None
        if subject:
            validate_subject(subject)
        subject_column = "subject" if "subject" in names else None
        if subject is None and subject_column is None:
            raise ConfigError("jetstream sink: no 'subject' column and no 'subject' option")
        if "data" in names:
            data_column = "data"
        elif "payload" in names:
            data_column = "payload"
        else:
            raise ConfigError("jetstream sink: no 'data' (binary or string) or 'payload' column")
        if not isinstance(schema[data_column].dataType, BinaryType | StringType):
            raise ConfigError(f"jetstream sink: column {data_column!r} must be binary or string")
        headers_column = None
        if "headers" in names:
            if not isinstance(schema["headers"].dataType, MapType):
                raise ConfigError("jetstream sink: column 'headers' must be a map<string,string>")
            headers_column = "headers"
        msg_id_column = options.get("msgidcolumn") or next(
            (c for c in ("msg_id", "id") if c in names), None
        )
        if msg_id_column and msg_id_column not in names:
            raise ConfigError(f"jetstream sink: msgIdColumn {msg_id_column!r} is not a column")
        keys = tuple(k.strip() for k in (options.get("keycolumns") or "").split(",") if k.strip())
        missing = [k for k in keys if k not in names]
        if missing:
            raise ConfigError(f"jetstream sink: keyColumns names unknown columns {missing}")
        return cls(
            subject=subject,
            subject_column=subject_column,
            data_column=data_column,
            headers_column=headers_column,
            msg_id_column=msg_id_column,
            key_columns=keys,
            max_in_flight=max(1, int(number("maxInFlight", 256))),
            rate=number("rate", 0.0),
            attempts=max(1, int(number("publishAttempts", 5))),
            timeout=number("publishTimeout", 5.0),
            report_path=options.get("reportpath") or None,
        )


def outgoing(
    opts: WriteOptions,
    subject: str | None,
    body: bytes | str | None,
    headers: Mapping[str, str] | Sequence[tuple[str, str]] | None,
    msg_id: str | None,
    key: Sequence[Any] = (),
) -> _Outgoing:
    """One row as the message to publish: subject checked, id given or derived."""
    subject = opts.subject or subject
    if not subject:
        raise ConfigError("jetstream sink: a row has no subject")
    validate_subject(subject)
    data = b"" if body is None else body.encode() if isinstance(body, str) else bytes(body)
    pairs = headers.items() if isinstance(headers, Mapping) else (headers or [])
    hdrs = {str(k): str(v) for k, v in pairs if v is not None}
    msg_id = msg_id or derive_msg_id(subject, data, key)
    hdrs["Nats-Msg-Id"] = str(msg_id)
    return _Outgoing(subject, data, hdrs, str(msg_id))


def _rows(batch: pa.RecordBatch, opts: WriteOptions) -> list[_Outgoing]:
    n = batch.num_rows

    def column(name: str | None) -> list[Any]:
        return batch.column(batch.schema.get_field_index(name)).to_pylist() if name else [None] * n

    subjects = column(None if opts.subject else opts.subject_column)
    bodies, headers, ids = (
        column(opts.data_column),
        column(opts.headers_column),
        column(opts.msg_id_column),
    )
    keys = [column(k) for k in opts.key_columns]
    return [
        outgoing(opts, subjects[i], bodies[i], headers[i], ids[i], [k[i] for k in keys])
        for i in range(n)
    ]


async def publish_window(
    client: SyncNats, items: list[_Outgoing], opts: WriteOptions, report: PublishReport
) -> None:
    """Publish ``items`` together; failed ones again with the same ids, then raise.

    A row too large for the server is refused before anything of the window is sent:
    sent, it would make the server close the connection.
    """
    js = client.js
    max_payload = getattr(client.nc, "max_payload", 0)
    limits = (
        SizeLimits(max_payload=max_payload)
        if isinstance(max_payload, int) and max_payload > 0
        else SizeLimits()
    )
    for item in items:
        check_fits(item.subject, item.data, item.headers, limits)
    pending = items
    for attempt in range(1, opts.attempts + 1):
        results = await asyncio.gather(
            *(
                js.publish(o.subject, o.data, timeout=opts.timeout, headers=o.headers)
                for o in pending
            ),
            return_exceptions=True,
        )
        failed: list[tuple[_Outgoing, BaseException]] = []
        for item, result in zip(pending, results, strict=True):
            if isinstance(result, BaseException):
                failed.append((item, result))
            elif result.duplicate:
                report.duplicates += 1
            else:
                report.stored += 1
        if not failed:
            return
        pending = [item for item, _ in failed]
        if attempt == opts.attempts:
            item, exc = failed[0]
            raise PublishError(
                f"publish to {item.subject!r} failed after {attempt} attempts: {one_line(exc, 300)}",
                kind="exhausted",
                retriable=True,
            )
        # the same ids go again: anything that did reach the stream is deduplicated
        await asyncio.sleep(min(0.1 * 2**attempt, 2.0))


def publish_batches(
    conn: ConnOptions, opts: WriteOptions, batches: Iterator[pa.RecordBatch]
) -> PublishReport:
    """Executor side: publish every row, window by window; counts in the report."""
    report = PublishReport()
    started = time.monotonic()
    with SyncNats(conn) as client:
        for batch in batches:
            rows = _rows(batch, opts)
            for i in range(0, len(rows), opts.max_in_flight):
                window = rows[i : i + opts.max_in_flight]
                client.run(publish_window(client, window, opts, report))
                report.rows += len(window)
                if opts.rate > 0:
                    # pace to the rate: never ahead of rows / rate seconds
                    ahead = report.rows / opts.rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
    return report


def _commit(
    opts: WriteOptions, messages: Sequence[WriterCommitMessage | None], batch_id: int | None
) -> dict[str, Any]:
    reports = [m for m in messages if isinstance(m, PublishReport)]
    total: dict[str, Any] = {
        "batch_id": batch_id,
        "tasks": len(reports),
        "rows": sum(r.rows for r in reports),
        "stored": sum(r.stored for r in reports),
        "duplicates": sum(r.duplicates for r in reports),
    }
    log.info(
        "jetstream sink committed%s: %d rows, %d stored, %d duplicates",
        "" if batch_id is None else f" batch {batch_id}",
        total["rows"],
        total["stored"],
        total["duplicates"],
    )
    if opts.report_path:
        with open(opts.report_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(total) + "\n")
    return total


class JetStreamWriter(DataSourceArrowWriter):
    """Batch write (``df.write.format("jetstream")``)."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.conn = ConnOptions.from_options(options)
        self.opts = WriteOptions.from_options(options, schema)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PublishReport:
        return publish_batches(self.conn, self.opts, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _commit(self.opts, messages, None)


class JetStreamStreamWriter(DataSourceStreamArrowWriter):
    """Streaming write (``df.writeStream.format("jetstream")``)."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.conn = ConnOptions.from_options(options)
        self.opts = WriteOptions.from_options(options, schema)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PublishReport:
        return publish_batches(self.conn, self.opts, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _commit(self.opts, messages, batchId)
