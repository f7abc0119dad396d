"""Entry point for ``spark-submit``: the ``meshforge pipeline`` commands on any cluster.

    PYSPARK_PYTHON=/opt/meshforge/bin/python spark-submit --master spark://host:7077 \\
        "$(/opt/meshforge/bin/python -c 'import meshforge.cli.spark_job as j; print(j.__file__)')" \\
        ingest --nats-url nats://nats:4222 --output s3a://bucket/meshforge

Arguments are those of ``meshforge pipeline``; the master comes from spark-submit. The
executors need MeshForge installed (docs/PIPELINE.md, "On a cluster"): its compiled
dependencies cannot travel in ``--py-files``.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Run ``meshforge pipeline <argv>``."""
    from meshforge.cli import main as cli_main

    sys.argv = ["meshforge", "pipeline", *(sys.argv[1:] if argv is None else argv)]
    cli_main()


if __name__ == "__main__":
    main()
