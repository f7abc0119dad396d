"""The ``jetstream`` sink: deterministic ids, counts of stored and duplicate messages."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from pyspark.sql import SparkSession
from pyspark.sql.types import MapType, StringType, StructField, StructType

from meshforge.spark.writer import derive_msg_id

pytestmark = pytest.mark.spark


def _reports(path: Path) -> list[dict[str, int]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_sink_job_run_twice_stores_each_id_once(
    spark: SparkSession, nats_url: str, js: JetStreamContext, stream: str, tmp_path: Path
) -> None:
    base = stream.lower()
    schema = StructType([
        StructField("subject", StringType()),
        StructField("payload", StringType()),
        StructField("headers", MapType(StringType(), StringType())),
    ])  # fmt: skip
    rows = [(f"{base}.w{i % 3}", json.dumps({"n": i}), {"X-N": str(i)}) for i in range(120)]
    df = spark.createDataFrame(rows, schema).repartition(3)
    report = tmp_path / "report.jsonl"

    def write() -> None:
        (df.write.format("jetstream").mode("append").option("servers", nats_url)
           .option("reportPath", str(report)).option("maxInFlight", "16").save())  # fmt: skip

    write()
    write()
    first, second = _reports(report)
    assert (first["rows"], first["stored"], first["duplicates"]) == (120, 120, 0)
    assert (second["rows"], second["stored"], second["duplicates"]) == (120, 0, 120)
    assert first["tasks"] == 3
    assert (await js.stream_info(stream)).state.messages == 120
    msg = await js.get_msg(stream, 1)
    assert msg.headers is not None and "X-N" in msg.headers
    n = json.loads(msg.data)["n"]
    assert msg.headers["Nats-Msg-Id"] == derive_msg_id(f"{base}.w{n % 3}", msg.data)


async def test_round_trip_keeps_ids_and_a_subject_option_redirects(
    spark: SparkSession, nats_url: str, js: JetStreamContext, stream: str, tmp_path: Path
) -> None:
    base = stream.lower()
    for i in range(10):
        await js.publish(f"{base}.src", b"%d" % i, headers={"Nats-Msg-Id": f"orig-{i}"})
    df = spark.read.format("jetstream").option("servers", nats_url).option("stream", stream).load()
    report = tmp_path / "r.jsonl"
    # rows keep their Nats-Msg-Id in headers; the sink derives ids from subject + data here
    (df.select("data", "headers").write.format("jetstream").mode("append")
       .option("servers", nats_url).option("subject", f"{base}.copy")
       .option("reportPath", str(report)).save())  # fmt: skip
    assert _reports(report)[0]["stored"] == 10
    copied = [await js.get_msg(stream, seq) for seq in range(11, 21)]
    assert {m.subject for m in copied} == {f"{base}.copy"}
    assert all(
        m.headers and m.headers["Nats-Msg-Id"] == derive_msg_id(f"{base}.copy", m.data)
        for m in copied
    )


async def test_streaming_sink_counts_each_batch(
    spark: SparkSession, nats_url: str, js: JetStreamContext, stream: str, tmp_path: Path
) -> None:
    base = stream.lower()
    for i in range(12):
        await js.publish(f"{base}.in", json.dumps({"id": f"k{i}"}).encode())
    report = tmp_path / "s.jsonl"
    src = (spark.readStream.format("jetstream").option("servers", nats_url).option("stream", stream)
           .option("startingOffsets", "earliest").option("filterSubject", f"{base}.in")
           .option("maxMessagesPerTrigger", "5").load())  # fmt: skip
    query = (
        src.selectExpr("data", "get_json_object(cast(data as string), '$.id') as msg_id")
        .writeStream.format("jetstream")
        .option("servers", nats_url)
        .option("subject", f"{base}.out")
        .option("reportPath", str(report))
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    batches = _reports(report)
    assert [b["batch_id"] for b in batches] == [0, 1, 2]
    assert sum(b["stored"] for b in batches) == 12
    ids = {(await js.get_msg(stream, seq)).headers["Nats-Msg-Id"] for seq in range(13, 25)}  # type: ignore[index]
    assert ids == {f"k{i}" for i in range(12)}


def test_sink_refuses_rows_it_cannot_publish(spark: SparkSession, nats_url: str) -> None:
    df = spark.createDataFrame([("x",)], "payload string")
    with pytest.raises(Exception, match="no 'subject' column and no 'subject' option"):
        df.write.format("jetstream").mode("append").option("servers", nats_url).save()
    bad = spark.createDataFrame([("bad subject", "x")], "subject string, payload string")
    with pytest.raises(Exception, match="invalid subject 'bad subject'"):
        bad.write.format("jetstream").mode("append").option("servers", nats_url).save()


async def test_replay_dry_run_then_twice_with_a_rate(
    spark: SparkSession, nats_url: str, js: JetStreamContext, stream: str, tmp_path: Path
) -> None:
    from meshforge.envelope import Envelope
    from meshforge.spark.pipelines import ingest, replay

    base = stream.lower()
    sent = [Envelope.new("order.created", {"n": i}) for i in range(20)]
    for env in sent:
        await js.publish(f"{base}.orig", env.encode(), headers=env.headers())
    landed = ingest(spark, nats_url, stream, tmp_path / "t")
    assert landed.rows == 20
    target = f"{stream}_R"
    await js.add_stream(name=target, subjects=[f"{target.lower()}.>"])
    try:
        dry = replay(spark, str(tmp_path / "t"), f"{target.lower()}.again", None, dry_run=True)
        assert (dry.rows, dry.stored, len(dry.sample)) == (20, 0, 10)
        assert dry.sample[0]["msg_id"] == sent[0].id  # stored order, envelope ids kept
        assert (await js.stream_info(target)).state.messages == 0
        started = time.monotonic()
        first = replay(spark, str(tmp_path / "t"), f"{target.lower()}.again", nats_url, rate=200)
        assert time.monotonic() - started >= 0.09  # 20 rows at 200/s
        second = replay(
            spark,
            str(tmp_path / "t"),
            f"{target.lower()}.again",
            nats_url,
            where="type = 'order.created'",
        )
        assert (first.rows, first.stored, first.duplicates) == (20, 20, 0)
        assert (second.rows, second.stored, second.duplicates) == (20, 0, 20)
        msg = await js.get_msg(target, 1)
        assert msg.headers is not None and msg.headers["Nats-Msg-Id"] == sent[0].id
    finally:
        await js.delete_stream(target)


async def test_replay_of_dead_letters_goes_to_the_original_subject(
    spark: SparkSession, nats_url: str, js: JetStreamContext, stream: str
) -> None:
    from meshforge.spark.pipelines import replay

    base = stream.lower()
    rows = [
        ("MESHFORGE_FAILED", 1, f"failed.{base}.a", {"Dlq-Reason": "unrecoverable", "Dlq-Original-Subject": f"{base}.a", "Nats-Msg-Id": "m1"}, b"{}"),
        ("MESHFORGE_FAILED", 2, f"failed.{base}.b", {"Dlq-Reason": "malformed", "Nats-Msg-Id": "m2"}, b"x"),
        ("MESHFORGE_FAILED", 3, "failed.original.MESHFORGE_COMMANDS.7", {"Dlq-Chunk": "1/1"}, b"copy"),
    ]  # fmt: skip
    df = spark.createDataFrame(
        rows, "stream string, seq long, subject string, headers map<string,string>, data binary"
    )
    result = replay(spark, df, None, nats_url)
    assert (result.rows, result.stored) == (2, 2)
    first, second = await js.get_msg(stream, 1), await js.get_msg(stream, 2)
    assert (first.subject, second.subject) == (f"{base}.a", f"{base}.b")
    assert first.headers is not None and not [h for h in first.headers if h.startswith("Dlq-")]
