"""SECURITY.md: the pipeline commands make Spark redact options named like a password,
token or seed from its plans and logs (``spark.redaction.regex``)."""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.sql import SparkSession

import meshforge.spark.pipelines
from meshforge.cli.pipeline import _session

PLANTED = {
    "password": "planted-password",
    "token": "planted-token",
    "nkey_seed": "SUAPLANTEDSEED",
    "nkey_seed_file": "/run/planted/seed.nk",
}


def test_pipeline_sessions_make_spark_redact_passwords_tokens_and_seeds(
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: dict[str, str] = {}

    def capture(master: str | None = None, *, conf: Any = None, **_: Any) -> SparkSession:
        built.update(conf or {})
        return spark  # the test session: the conf is what this test reads

    monkeypatch.setattr(meshforge.spark.pipelines, "spark_session", capture)
    _session(None, ["spark.sql.shuffle.partitions=2"])
    regex = built["spark.redaction.regex"]

    # Spark's own redaction (SparkConf.toDebugString goes through Utils.redact) with that regex
    conf = spark._jvm.org.apache.spark.SparkConf(False)  # type: ignore[union-attr]
    conf.set("spark.redaction.regex", regex).set("user", "planted-user")
    for key, value in PLANTED.items():
        conf.set(key, value)
    shown = conf.toDebugString()
    assert not [v for v in PLANTED.values() if v in shown], shown
    assert all(f"{key}=*********(redacted)" in shown for key in PLANTED), shown
    assert "user=planted-user" in shown  # only secrets are hidden
