"""The ``jetstream`` Spark data source: batch and streaming reads, batch and streaming writes.

Example::

    import meshforge.spark
    meshforge.spark.register(spark)
    df = (spark.read.format("jetstream")
          .option("servers", "nats://127.0.0.1:4222")
          .option("stream", "MESHFORGE_EVENTS")
          .option("envelope", "true")
          .load())

Read options: ``servers``, ``stream`` (required), ``filterSubject``, ``envelope``,
``partitions`` / ``minPartitions`` / ``messagesPerPartition``, ``startingOffsets``,
``endingOffsets`` (batch), ``maxMessagesPerTrigger`` (streaming), ``failOnDataLoss``,
``fetchBatch``, and the connection options ``user``, ``password``, ``token``,
``nkey_seed``, ``nkey_seed_file``, ``creds``, ``tls_ca``, ``tls_cert``, ``tls_key``,
``inbox_prefix``, ``connect_timeout``, ``connect_attempts`` (see :class:`meshforge.spark.nats_sync.ConnOptions`).
Write options: see :mod:`meshforge.spark.writer`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from meshforge.errors import ConnectionFailed
from meshforge.spark.fetch import read_range
from meshforge.spark.nats_sync import ConnOptions, StreamInfo, SyncNats
from meshforge.spark.offsets import (
    ReadOptions,
    SeqRange,
    check_data_loss,
    resolve_offset,
    split_range,
)
from meshforge.spark.schema import arrow_schema, row_schema, to_record_batch

__all__ = ["JetStreamDataSource"]

log = logging.getLogger("meshforge.spark")

_IDLE = 60.0  # seconds a driver-side connection may sit unused before it is renewed


def _read_partition(
    conn: ConnOptions, opts: ReadOptions, schema: StructType, part: SeqRange
) -> Iterator[pa.RecordBatch]:
    """Executor side: one partition's messages as Arrow record batches."""
    target = arrow_schema(schema)
    with SyncNats(conn) as client:
        info = client.stream_info(opts.stream)
        first = (
            check_data_loss(info, part.first, opts.fail_on_data_loss)
            if part.check_loss
            else part.first
        )
        for chunk in read_range(
            client,
            opts.stream,
            first,
            part.last,
            retention=info.retention,
            filter_subject=opts.filter_subject,
            batch=opts.batch,
            avg_size=info.avg_size,
        ):
            yield to_record_batch(opts.stream, chunk, target, envelope=opts.envelope)


class JetStreamDataSource(DataSource):
    """A JetStream stream as a Spark table (``format("jetstream")``)."""

    @classmethod
    def name(cls) -> str:
        return "jetstream"

    def schema(self) -> StructType:
        envelope = str(self.options.get("envelope", "false")).strip().lower() in (
            "true",
            "1",
            "yes",
        )
        return row_schema(envelope=envelope)

    def reader(self, schema: StructType) -> DataSourceReader:
        return JetStreamBatchReader(dict(self.options), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return JetStreamStreamReader(dict(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from meshforge.spark.writer import JetStreamWriter

        return JetStreamWriter(dict(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from meshforge.spark.writer import JetStreamStreamWriter

        return JetStreamStreamWriter(dict(self.options), schema)


class JetStreamBatchReader(DataSourceReader):
    """Batch read: the sequence range split into contiguous partitions read in parallel."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.conn = ConnOptions.from_options(options)
        self.opts = ReadOptions.from_options(options)
        self.schema = schema

    def partitions(self) -> Sequence[InputPartition]:
        with SyncNats(self.conn) as client:
            info = client.stream_info(self.opts.stream)
            start = resolve_offset(self.opts.starting, "earliest", info, client, "startingOffsets")
            end = resolve_offset(self.opts.ending, "latest", info, client, "endingOffsets")
        explicit = (
            self.opts.starting is not None and self.opts.starting.strip().lower() != "earliest"
        )
        if explicit:
            start = check_data_loss(info, start, self.opts.fail_on_data_loss)
        ranges = split_range(start, min(end, info.next_seq), self.opts)
        for part in ranges:
            part.check_loss = explicit and self.opts.fail_on_data_loss
        return list(ranges)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, SeqRange):
            return iter(())  # Spark's placeholder for an empty range
        return _read_partition(self.conn, self.opts, self.schema, partition)


class JetStreamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Streaming read: offsets are ``{"<STREAM>": next_seq}``; ``maxMessagesPerTrigger``
    bounds each micro-batch; ``Trigger.AvailableNow`` stops at the sequence current
    when the query started."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.conn = ConnOptions.from_options(options)
        self.opts = ReadOptions.from_options(options)
        self.schema = schema
        self._client: SyncNats | None = None
        self._used = 0.0
        self._target: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None  # a connection never travels to executors
        return state

    def _info(self) -> tuple[StreamInfo, SyncNats]:
        # between micro-batches the server may have gone and come back (the client does
        # not reconnect by itself): renew after a pause, and once more on failure
        if self._client is not None and (
            not self._client.connected or time.monotonic() - self._used > _IDLE
        ):
            self._client.close()
            self._client = None
        for attempt in (1, 2):
            if self._client is None:
                self._client = SyncNats(self.conn)
            try:
                info = self._client.stream_info(self.opts.stream)
            except ConnectionFailed:
                self._client.close()
                self._client = None
                if attempt == 2:
                    raise
                continue
            self._used = time.monotonic()
            return info, self._client
        raise AssertionError("unreachable")

    def _offset(self, seq: int) -> dict[str, int]:
        return {self.opts.stream: seq}

    def _seq(self, offset: dict[str, Any]) -> int:
        return int(offset[self.opts.stream])

    def initialOffset(self) -> dict[str, int]:
        info, client = self._info()
        start = resolve_offset(self.opts.starting, "latest", info, client, "startingOffsets")
        return self._offset(start)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_per_trigger:
            return ReadMaxRows(self.opts.max_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        info, _ = self._info()
        self._target = info.next_seq

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        info, _ = self._info()
        begin = self._seq(start)
        latest = info.next_seq if self._target is None else min(info.next_seq, self._target)
        if latest <= begin:
            return self._offset(begin)
        # purged messages: fail here, on the driver, or read from what is left
        effective = check_data_loss(info, begin, self.opts.fail_on_data_loss)
        if isinstance(limit, ReadMaxRows):
            # a sequence span bounds the row count (gaps and filters only make it smaller)
            latest = min(latest, max(effective, begin) + limit.max_rows)
        elif isinstance(limit, ReadMinRows) and latest - effective < limit.min_rows:
            return self._offset(begin)
        return self._offset(latest)

    def reportLatestOffset(self) -> dict[str, int] | None:
        try:
            info, _ = self._info()
        except Exception:
            return None
        return self._offset(info.next_seq)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return split_range(self._seq(start), self._seq(end), self.opts)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SeqRange)
        return _read_partition(self.conn, self.opts, self.schema, partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to release: the reader holds no durable consumer."""

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
