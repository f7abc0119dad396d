"""Streaming reads of the ``jetstream`` source into Spark's exactly-once file sink."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery
from spark_support import publish_many

from polling import wait_until_sync as wait_until

pytestmark = pytest.mark.spark


def _stream_df(spark: SparkSession, url: str, stream: str, **options: str) -> DataFrame:
    r = spark.readStream.format("jetstream").option("servers", url).option("stream", stream)
    r = r.option("startingOffsets", "earliest")
    for key, value in options.items():
        r = r.option(key, value)
    return r.load()


def _to_parquet(
    df: DataFrame, out: Path, checkpoint: Path, *, available_now: bool = True
) -> StreamingQuery:
    w = df.writeStream.format("parquet").option("checkpointLocation", str(checkpoint))
    w = w.trigger(availableNow=True) if available_now else w.trigger(processingTime="0 seconds")
    return w.start(str(out))


def _seqs(spark: SparkSession, out: Path) -> list[int]:
    return sorted(r.seq for r in spark.read.parquet(str(out)).select("seq").collect())


async def test_stopped_and_restarted_query_neither_loses_nor_repeats(
    spark: SparkSession, nats_url: str, js: JetStreamContext, stream: str, tmp_path: Path
) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    await publish_many(js, f"{stream.lower()}.a", 300)
    query = _to_parquet(
        _stream_df(spark, nats_url, stream, maxMessagesPerTrigger="40"),
        out,
        ckpt,
        available_now=False,
    )
    try:
        wait_until(lambda: len(query.recentProgress) >= 2, what="two micro-batches")
    finally:
        query.stop()  # may interrupt a micro-batch half-way
    landed_before = _seqs(spark, out)
    assert 0 < len(landed_before) < 300
    await publish_many(js, f"{stream.lower()}.a", 50, start=300)
    again = _to_parquet(_stream_df(spark, nats_url, stream, maxMessagesPerTrigger="40"), out, ckpt)
    again.awaitTermination()
    assert again.exception() is None
    assert _seqs(spark, out) == list(range(1, 351))


async def test_max_messages_per_trigger_bounds_each_micro_batch(
    spark: SparkSession, nats_url: str, js: JetStreamContext, stream: str, tmp_path: Path
) -> None:
    await publish_many(js, f"{stream.lower()}.a", 95)
    query = _to_parquet(
        _stream_df(spark, nats_url, stream, maxMessagesPerTrigger="20"),
        tmp_path / "o",
        tmp_path / "c",
    )
    query.awaitTermination()
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert sizes and max(sizes) <= 20
    assert sum(sizes) == 95 and len(sizes) >= 5
    last = query.recentProgress[-1]["sources"][0]
    assert json.loads(last["endOffset"]) == {stream: 96}


async def test_fail_on_data_loss_after_a_purge(
    spark: SparkSession, nats_url: str, js: JetStreamContext, stream: str, tmp_path: Path
) -> None:
    out, ckpt, subject = tmp_path / "out", tmp_path / "ckpt", f"{stream.lower()}.a"
    await publish_many(js, subject, 10)
    _to_parquet(_stream_df(spark, nats_url, stream), out, ckpt).awaitTermination()
    assert _seqs(spark, out) == list(range(1, 11))
    await publish_many(js, subject, 10, start=10)  # 11..20, never read
    await js.purge_stream(stream)
    await publish_many(js, subject, 5, start=20)  # 21..25
    failing = _to_parquet(_stream_df(spark, nats_url, stream), out, ckpt)
    with pytest.raises(Exception, match=r"messages 11\.\.20 were removed before they were read"):
        failing.awaitTermination()
    skipping = _to_parquet(_stream_df(spark, nats_url, stream, failOnDataLoss="false"), out, ckpt)
    skipping.awaitTermination()
    assert skipping.exception() is None
    assert _seqs(spark, out) == [*range(1, 11), *range(21, 26)]
