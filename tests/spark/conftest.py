"""Spark fixtures: one local SparkSession for the whole session, the sources registered.

Executors run this interpreter (``PYSPARK_PYTHON``) so they import the same MeshForge.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from nats.js import JetStreamContext
from pyspark.sql import SparkSession

import meshforge.spark


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # local mode stays on loopback
    session = (
        SparkSession.builder.master("local[2]")
        .appName("meshforge-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    meshforge.spark.register(session)
    yield session
    session.stop()


@pytest.fixture
async def stream(js: JetStreamContext) -> AsyncIterator[str]:
    """A fresh limits stream of the test's own, capturing ``<name lower>.>``."""
    name = f"SPK_{uuid.uuid4().hex[:8].upper()}"
    await js.add_stream(name=name, subjects=[f"{name.lower()}.>"])
    yield name
    await js.delete_stream(name)
