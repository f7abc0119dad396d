"""The ``jetstream`` source's row layout and the Arrow record batches built from a chunk.

Rows: ``stream, subject, seq, ts, headers, data``. With ``envelope=true`` the envelope's
fields follow as columns (``envelope_ts`` is the envelope's own ``ts``, since ``ts`` is
the time the stream stored the message), then ``envelope_error``: null for a valid
envelope, else why it is malformed (its other envelope columns are then null).

Example::

    schema = row_schema(envelope=True)
    batch = to_record_batch("MESHFORGE_EVENTS", chunk, arrow_schema(schema), envelope=True)
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.types import (
    BinaryType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from meshforge.errors import MalformedMessage
from meshforge.spark.fetch import Chunk

__all__ = ["ENVELOPE_COLUMNS", "arrow_schema", "row_schema", "to_record_batch"]

BASE_COLUMNS = ("stream", "subject", "seq", "ts", "headers", "data")
_ENVELOPE_STRINGS = (
    "id", "type", "source", "tenant_id", "resource_type", "resource_id", "idempotency_key",
    "causation_id", "correlation_id", "trace_id", "span_id",
)  # fmt: skip
ENVELOPE_COLUMNS = (
    *_ENVELOPE_STRINGS,
    "envelope_ts",
    "schema_version",
    "payload",
    "envelope_error",
)
_ENCODER = msgspec.json.Encoder()


def row_schema(*, envelope: bool = False) -> StructType:
    """The Spark schema of the rows, with the envelope columns when asked."""
    fields = [
        StructField("stream", StringType(), False),
        StructField("subject", StringType(), False),
        StructField("seq", LongType(), False),
        StructField("ts", TimestampType(), False),
        StructField("headers", MapType(StringType(), StringType(), True), False),
        StructField("data", BinaryType(), False),
    ]
    if envelope:
        fields += [StructField(name, StringType(), True) for name in _ENVELOPE_STRINGS]
        fields += [
            StructField("envelope_ts", TimestampType(), True),
            StructField("schema_version", StringType(), True),
            StructField("payload", StringType(), True),
            StructField("envelope_error", StringType(), True),
        ]
    return StructType(fields)


def arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema Spark expects for ``schema`` (it checks for exact equality)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


def _micros(ts: str | None) -> int | None:
    if not ts:
        return None
    try:
        parsed = datetime.fromisoformat(ts)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None
    return int(parsed.timestamp()) * 1_000_000 + parsed.microsecond


def _envelope_columns(chunk: Chunk) -> dict[str, list[Any]]:
    from meshforge.envelope import decode

    cols: dict[str, list[Any]] = {name: [] for name in ENVELOPE_COLUMNS}
    for data, headers, ts_ns in zip(chunk.data, chunk.headers, chunk.ts_ns, strict=True):
        try:
            # a body without ts gets the stored time, as the runtime does
            stored = datetime.fromtimestamp(ts_ns / 1e9, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            env = decode(data, headers, default_ts=stored)
        except MalformedMessage as exc:
            for name in ENVELOPE_COLUMNS:
                cols[name].append(None)
            cols["envelope_error"][-1] = str(exc)
            continue
        for name in _ENVELOPE_STRINGS:
            cols[name].append(getattr(env, name))
        cols["envelope_ts"].append(_micros(env.ts))
        cols["schema_version"].append(env.schema_version)
        cols["payload"].append(_ENCODER.encode(env.payload).decode())
        cols["envelope_error"].append(None)
    return cols


def to_record_batch(
    stream: str, chunk: Chunk, schema: pa.Schema, *, envelope: bool = False
) -> pa.RecordBatch:
    """One Arrow record batch of ``chunk`` in the layout of ``schema``."""
    n = len(chunk)
    ts_type = schema.field("ts").type
    micros = pc.divide(pa.array(chunk.ts_ns, pa.int64()), 1000)
    headers_type = schema.field("headers").type
    arrays: list[pa.Array] = [
        pa.array([stream] * n, pa.string()),
        pa.array(chunk.subjects, pa.string()),
        pa.array(chunk.seqs, pa.int64()),
        micros.cast(ts_type),
        pa.array([list(h.items()) if h else [] for h in chunk.headers], headers_type),
        pa.array(chunk.data, pa.binary()),
    ]
    if envelope:
        cols = _envelope_columns(chunk)
        for name in ENVELOPE_COLUMNS:
            field_type = schema.field(name).type
            if name == "envelope_ts":
                arrays.append(pa.array(cols[name], pa.int64()).cast(field_type))
            else:
                arrays.append(pa.array(cols[name], field_type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
