"""``meshforge pipeline``: ingest through spark-submit --master local[2], audit's exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest
from pyspark.sql import SparkSession
from typer.testing import CliRunner

import meshforge.cli.spark_job
from meshforge.cli import app
from meshforge.envelope import Envelope, Outbound
from meshforge.transport.server import EmbeddedServer

pytestmark = pytest.mark.spark

EVT = "evt.default.demo.order.created"


async def _publish(url: str, events: list[Envelope], *, create: bool = False) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    if create:
        await js.add_stream(name="MESHFORGE_EVENTS", subjects=["evt.>"])
    for env in events:
        out = Outbound.of(EVT, env)
        await js.publish(out.subject, out.data, headers=out.headers)
    await nc.close()


def _audit(out: Path) -> tuple[int, dict[str, Any], str]:
    result = CliRunner().invoke(app, ["pipeline", "audit", "--output", str(out), "--store", ""])
    return result.exit_code, json.loads((out / "report" / "audit.json").read_text()), result.output


# A bound against a hang, not a speed test: JVMs of its own beside the suite's other
# workers on 2 cores took 300 s (alone, about 130 s).
@pytest.mark.timeout(900)
async def test_spark_submit_ingest_then_audit_exit_code(
    spark: SparkSession, private_server: EmbeddedServer, tmp_path: Path
) -> None:
    url, out = private_server.url, tmp_path / "pipeline"
    event = Envelope.new("order.create", {"sku": "A"}).child("order.created", {"n": 1}, position=0)
    await _publish(url, [event], create=True)
    spark_submit = Path(sys.executable).parent / "spark-submit"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "MESHFORGE_HOME": str(tmp_path / "home"),
           "SPARK_LOCAL_IP": "127.0.0.1"}  # fmt: skip
    env.pop("PYSPARK_GATEWAY_PORT", None)
    done = subprocess.run(  # noqa: ASYNC221 - the test waits for spark-submit on purpose
        [str(spark_submit), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
         meshforge.cli.spark_job.__file__, "ingest", "--nats-url", url, "--output", str(out)],
        env=env, capture_output=True, text=True, timeout=450, cwd=tmp_path,
    )  # fmt: skip
    said = done.stdout + done.stderr  # spark-submit merges the driver's stderr into stdout
    assert done.returncode == 0, said[-3000:]
    assert "MESHFORGE_EVENTS: 1 new rows" in said and "skipping MESHFORGE_FAILED" in said

    code, report, output = _audit(out)
    assert (code, report["counts"]["events"], report["counts"]["duplicate_effects"]) == (0, 1, 0), (
        output
    )
    assert "report:" in output and (out / "report" / "audit.html").is_file()

    # the same output again under a fresh id: a doubled effect, and a non-zero exit
    await _publish(url, [event.with_(id=str(uuid.uuid4()))])
    ingested = CliRunner().invoke(
        app, ["pipeline", "ingest", "--nats-url", url, "--output", str(out), "--master", "local[2]"]
    )
    assert ingested.exit_code == 0, ingested.output
    code, report, output = _audit(out)
    assert (code, report["counts"]["events"], report["counts"]["duplicate_effects"]) == (1, 2, 1), (
        output
    )
    assert "VIOLATED" in output
