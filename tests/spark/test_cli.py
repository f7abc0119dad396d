"""``meshforge pipeline`` in process, local mode: the report a cluster must equal, and
audit's exit code. ``spark-submit`` and ``job.py`` are test_standalone.py's."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest
from pyspark.sql import SparkSession
from spark_support import (
    DEAD_LETTERS,
    EVENTS,
    PIPELINE_REPORT,
    pipeline_report,
    publish_pipeline_run,
)
from typer.testing import CliRunner

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


def _ingest(url: str, out: Path) -> str:
    result = CliRunner().invoke(
        app, ["pipeline", "ingest", "--nats-url", url, "--output", str(out), "--master", "local[2]"]
    )
    assert result.exit_code == 0, result.output
    return result.output


async def test_local_mode_gives_the_report_a_cluster_must_equal(
    spark: SparkSession, private_server: EmbeddedServer, tmp_path: Path
) -> None:
    await publish_pipeline_run(private_server.url)
    local = tmp_path / "local"
    _ingest(private_server.url, local)
    code, _, output = _audit(local)
    assert code == 0, output
    assert pipeline_report(local) == PIPELINE_REPORT
    counts = [spark.read.parquet(str(local / name)).count() for name in ("events", "failed")]
    assert counts == [EVENTS, DEAD_LETTERS]


async def test_ingest_then_audit_exit_code(
    spark: SparkSession, private_server: EmbeddedServer, tmp_path: Path
) -> None:
    url, out = private_server.url, tmp_path / "pipeline"
    event = Envelope.new("order.create", {"sku": "A"}).child("order.created", {"n": 1}, position=0)
    await _publish(url, [event], create=True)
    said = _ingest(url, out)
    assert "skipping MESHFORGE_FAILED" in said, said

    code, report, output = _audit(out)
    assert (code, report["counts"]["events"], report["counts"]["duplicate_effects"]) == (0, 1, 0), (
        output
    )
    assert "report:" in output and (out / "report" / "audit.html").is_file()

    # the same output again under a fresh id: a doubled effect, and a non-zero exit
    await _publish(url, [event.with_(id=str(uuid.uuid4()))])
    _ingest(url, out)
    code, report, output = _audit(out)
    assert (code, report["counts"]["events"], report["counts"]["duplicate_effects"]) == (1, 2, 1), (
        output
    )
    assert "VIOLATED" in output
