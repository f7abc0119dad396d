"""Batch reads of the ``jetstream`` source against a real server."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from nats.js import JetStreamContext
from pyspark.sql import SparkSession
from spark_support import publish_many

pytestmark = pytest.mark.spark


def _reader(spark: SparkSession, url: str, stream: str, **options: str):  # type: ignore[no-untyped-def]
    r = spark.read.format("jetstream").option("servers", url).option("stream", stream)
    for key, value in options.items():
        r = r.option(key, value)
    return r.load()


async def test_batch_read_gives_every_message_with_content_and_headers(
    spark: SparkSession, nats_url: str, js: JetStreamContext, stream: str
) -> None:
    subject = f"{stream.lower()}.orders"
    await publish_many(js, subject, 250)
    rows = _reader(spark, nats_url, stream).orderBy("seq").collect()
    assert len(rows) == 250
    assert [r.seq for r in rows] == list(range(1, 251))
    for i, row in enumerate(rows):
        assert row.stream == stream
        assert row.subject == subject
        assert json.loads(row.data) == {"i": i}
        assert row.headers["X-Index"] == str(i)
        assert row.headers["Nats-Msg-Id"] == f"m-{subject}-{i}"
        assert row.ts.tzinfo is None or row.ts.tzinfo == UTC
    assert rows[0].ts <= rows[-1].ts


async def test_partitioned_read_covers_every_sequence_once_across_gaps(
    spark: SparkSession, nats_url: str, js: JetStreamContext, stream: str
) -> None:
    await publish_many(js, f"{stream.lower()}.a", 400)
    deleted = {5, 100, 101, 250, 400}
    for seq in deleted:
        await js.delete_msg(stream, seq)
    df = _reader(spark, nats_url, stream, partitions="4", fetchBatch="37")
    assert df.rdd.getNumPartitions() == 4
    seqs = [r.seq for r in df.select("seq").collect()]
    assert len(seqs) == len(set(seqs)) == 400 - len(deleted)
    assert set(seqs) == set(range(1, 401)) - deleted
    # per partition: contiguous, ordered ranges
    per_part = df.rdd.mapPartitions(lambda it: [[r.seq for r in it]]).collect()
    assert all(p == sorted(p) for p in per_part)
    assert sum(len(p) for p in per_part) == 395


async def test_offsets_filter_and_envelope_columns(
    spark: SparkSession, nats_url: str, js: JetStreamContext, stream: str
) -> None:
    base = stream.lower()
    for i in range(30):
        body = {
            "id": f"e-{i}", "type": "order.created", "source": "t", "tenant_id": "default",
            "causation_id": f"c-{i}", "ts": "2026-01-02T03:04:05.123456Z", "payload": {"n": i},
        }  # fmt: skip
        await js.publish(f"{base}.{'even' if i % 2 == 0 else 'odd'}", json.dumps(body).encode())
    await js.publish(f"{base}.even", b"not json")
    rows = _reader(
        spark, nats_url, stream, filterSubject=f"{base}.even", envelope="true",
        startingOffsets=json.dumps({stream: 11}), endingOffsets=json.dumps({stream: 32}),
    ).orderBy("seq").collect()  # fmt: skip
    assert [r.seq for r in rows] == [11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31]
    good, bad = rows[:-1], rows[-1]
    assert (
        good[0].id == "e-10" and good[0].causation_id == "c-10" and good[0].type == "order.created"
    )
    assert json.loads(good[0].payload) == {"n": 10}
    # collect() gives a naive datetime in the driver's local zone: compare the instant
    assert good[0].envelope_ts.astimezone(UTC) == datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
    assert good[0].envelope_error is None
    assert bad.id is None and "body is not JSON: " in bad.envelope_error
    # latest: nothing; a time before everything: all 31
    assert _reader(spark, nats_url, stream, startingOffsets="latest").count() == 0
    assert _reader(spark, nats_url, stream, startingOffsets="2000-01-01T00:00:00Z").count() == 31


async def test_work_queue_stream_is_read_without_consuming(
    spark: SparkSession, nats_url: str, js: JetStreamContext
) -> None:
    await js.add_stream(name="SPK_WQ", subjects=["spkwq.>"], retention="workqueue")
    try:
        await publish_many(js, "spkwq.jobs", 40)
        await js.delete_msg("SPK_WQ", 7)
        seqs = sorted(r.seq for r in _reader(spark, nats_url, "SPK_WQ", partitions="2").collect())
        assert seqs == [s for s in range(1, 41) if s != 7]
        filtered = _reader(spark, nats_url, "SPK_WQ", filterSubject="spkwq.jobs").count()
        assert filtered == 39
        assert (await js.stream_info("SPK_WQ")).state.messages == 39
    finally:
        await js.delete_stream("SPK_WQ")


async def test_purged_start_fails_clearly_or_skips(
    spark: SparkSession, nats_url: str, js: JetStreamContext, stream: str
) -> None:
    await publish_many(js, f"{stream.lower()}.x", 20)
    await js.purge_stream(stream, keep=5)
    start = json.dumps({stream: 3})
    with pytest.raises(Exception, match=r"messages 3\.\.15 were removed before they were read"):
        _reader(spark, nats_url, stream, startingOffsets=start).count()
    assert (
        _reader(spark, nats_url, stream, startingOffsets=start, failOnDataLoss="false").count() == 5
    )


def test_missing_stream_and_bad_options_are_one_line_errors(
    spark: SparkSession, nats_url: str
) -> None:
    with pytest.raises(Exception, match="stream 'NOPE' not found"):
        _reader(spark, nats_url, "NOPE").count()
    with pytest.raises(Exception, match="option 'partitions' must be an integer"):
        _reader(spark, nats_url, "NOPE", partitions="many").count()
