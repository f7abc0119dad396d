"""The Spark source and sink under exactly what `meshforge permissions spark` prints: they
take their replies on the user's own inbox (`_INBOX_<user>.>`), the only one it may read."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.transport.server import EmbeddedServer

pytestmark = pytest.mark.spark


def test_the_source_and_sink_run_under_the_printed_spark_role(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spark_block = (
        CliRunner()
        .invoke(app, ["permissions", "spark", "--user", "lake", "--write", "evt.default.lake.>"])
        .output
    )
    admin_block = CliRunner().invoke(app, ["permissions", "admin", "--user", "ops"]).output
    assert '"_INBOX_lake.>"' in spark_block and '"_INBOX.>"' not in spark_block
    users = [
        b.split("users = [\n", 1)[1].rsplit("\n  ]\n}", 1)[0] for b in (spark_block, admin_block)
    ]
    conf = tmp_path / "auth.conf"
    conf.write_text("authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}\n")
    monkeypatch.setenv("LAKE_PASSWORD", "pw-lake")
    monkeypatch.setenv("OPS_PASSWORD", "pw-ops")
    with EmbeddedServer(store_dir=tmp_path / "nats", extra_args=["-c", str(conf)]) as server:
        admin = CliRunner().invoke(
            app, ["provision", "--nats-url", server.url],
            env={"MESHFORGE_USER": "ops", "MESHFORGE_PASSWORD": "pw-ops"},
        )  # fmt: skip
        assert admin.exit_code == 0, admin.output
        auth = {
            "servers": server.url,
            "user": "lake",
            "password": "pw-lake",
            "connect_attempts": "1",
        }
        rows = [
            ("evt.default.lake.x.written", '{"n": 1}'),
            ("evt.default.lake.x.written", '{"n": 2}'),
        ]
        df = spark.createDataFrame(rows, "subject string, payload string")
        df.write.format("jetstream").mode("append").options(**auth).save()
        read = (
            spark.read.format("jetstream")
            .options(**auth)
            .option("stream", "MESHFORGE_EVENTS")
            .load()
        )
        assert sorted(r.subject for r in read.collect()) == ["evt.default.lake.x.written"] * 2
        violations = [
            line for line in server.log_file.read_text().splitlines() if "Violation" in line
        ]
        assert violations == [], violations
