"""The source and the sink give up on a bad URL or a wrong password, bounded, without
printing the password (before, the Spark-side client retried a refused port for ever)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from meshforge.transport.server import EmbeddedServer

pytestmark = pytest.mark.spark

PASSWORD = "Spark-pw-planted-4417"
# connect_timeout 1 x 2 attempts and a bounded close, plus Spark's own job overhead, which
# on a loaded machine takes tens of seconds (before, the read never ended)
BOUND = 2 + 1.5 + 60


def test_source_and_sink_fail_bounded_without_the_password(
    spark: SparkSession, tmp_path: Path
) -> None:
    retry = {"connect_timeout": "1", "connect_attempts": "2"}
    started = time.monotonic()
    with pytest.raises(Exception) as read_error:  # Spark wraps the Python error
        (spark.read.format("jetstream").options(**retry)
         .option("servers", f"nats://alice:{PASSWORD}@127.0.0.1:1")
         .option("stream", "MESHFORGE_EVENTS").load().count())  # fmt: skip
    assert time.monotonic() - started < BOUND
    text = str(read_error.value)
    assert "cannot connect to NATS at nats://***@127.0.0.1:1 after 2 attempt(s)" in text, text
    assert PASSWORD not in text

    args = ["--user", "alice", "--pass", "the-right-one"]
    with EmbeddedServer(store_dir=tmp_path / "nats", extra_args=args) as server:
        df = spark.createDataFrame([("evt.default.t.a.b", "{}")], "subject string, payload string")
        started = time.monotonic()
        with pytest.raises(Exception) as write_error:
            (df.write.format("jetstream").mode("append").options(**retry)
             .option("servers", server.url).option("user", "alice")
             .option("password", PASSWORD).save())  # fmt: skip
        assert time.monotonic() - started < BOUND
    text = str(write_error.value)
    assert "Authorization Violation" in text and "after 1 attempt(s)" in text, text
    assert PASSWORD not in text
