"""The Spark sink refuses a row too large for the server before sending anything of its window.

Sent, such a row would make the server close the connection; refused, the task fails with
one line naming the subject and the sizes, and the rows before it were not half-published.
(Executor-side code only: no SparkSession needed.)
"""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest
from nats.js import JetStreamContext
from pyspark.sql.types import BinaryType, StringType, StructField, StructType

from meshforge.errors import PublishError
from meshforge.spark.nats_sync import ConnOptions
from meshforge.spark.writer import WriteOptions, publish_batches

SCHEMA = StructType([StructField("subject", StringType()), StructField("data", BinaryType())])


async def test_a_row_over_max_payload_fails_the_window_before_it_is_sent(
    nats_url: str, js: JetStreamContext
) -> None:
    name = f"SINK_{uuid.uuid4().hex[:8].upper()}"
    await js.add_stream(name=name, subjects=[f"{name.lower()}.>"])
    try:
        subject = f"{name.lower()}.rows"
        limit = js._nc.max_payload  # type: ignore[attr-defined]
        batch = pa.record_batch(
            [pa.array([subject] * 3), pa.array([b"small", b"x" * limit, b"after"], pa.binary())],
            names=["subject", "data"],
        )
        opts = WriteOptions.from_options({}, SCHEMA)
        with pytest.raises(PublishError) as caught:
            publish_batches(ConnOptions.from_options({"servers": nats_url}), opts, iter([batch]))
        assert caught.value.kind == "payload_too_large" and subject in str(caught.value)
        assert "\n" not in str(caught.value)
        assert (await js.stream_info(name)).state.messages == 0
    finally:
        await js.delete_stream(name)
