"""MeshForge on Spark: the ``jetstream`` data source and the store tables as a source.

Example::

    import meshforge.spark
    meshforge.spark.register(spark)
    spark.read.format("jetstream").option("servers", url).option("stream", "MESHFORGE_EVENTS").load()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["register"]


def register(spark: SparkSession) -> None:
    """Register the ``jetstream`` and ``meshforge_store`` data sources with ``spark``.

    In local mode it first checks that Spark's Python workers can import MeshForge, so a
    worker interpreter without it is one clear error here, not a traceback deep in a job.
    """
    from meshforge.spark.source import JetStreamDataSource
    from meshforge.spark.store_source import StoreDataSource

    _check_local_workers(spark)
    spark.dataSource.register(JetStreamDataSource)
    spark.dataSource.register(StoreDataSource)


def _check_local_workers(spark: SparkSession) -> None:
    import subprocess

    from meshforge.errors import ConfigError

    try:
        context = spark.sparkContext
        master, python = context.master, context.pythonExec
    except Exception:  # Spark Connect has no SparkContext: the server's workers are not ours to see
        return
    if not master or not master.startswith("local") or not python:
        return
    try:
        found = (
            subprocess.run(
                [python, "-c", "import meshforge"], capture_output=True, timeout=60, check=False
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        found = False
    if not found:
        raise ConfigError(
            f"Spark's Python workers run {python!r}, which cannot import meshforge: set "
            "PYSPARK_PYTHON (or spark.pyspark.python) to the interpreter MeshForge is installed "
            "in, e.g. PYSPARK_PYTHON=$(which python), before the SparkSession starts"
        )
