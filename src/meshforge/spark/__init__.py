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
    """Register the ``jetstream`` and ``meshforge_store`` data sources with ``spark``."""
    from meshforge.spark.source import JetStreamDataSource
    from meshforge.spark.store_source import StoreDataSource

    spark.dataSource.register(JetStreamDataSource)
    spark.dataSource.register(StoreDataSource)
