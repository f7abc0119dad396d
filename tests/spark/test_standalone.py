"""The pipeline on a real Spark cluster: a standalone master and worker on loopback.

``meshforge pipeline ingest`` and ``audit`` go through ``spark-submit`` and ``job.py``
exactly as docs/PIPELINE.md ("On a cluster") tells a user, with MeshForge reaching the
executors the documented way (installed in the interpreter that ``PYSPARK_PYTHON``
names on every node); the report equals the one local mode gives (test_cli.py), and no
JVM is started here but the cluster's and spark-submit's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from spark_support import (
    DEAD_LETTERS,
    EVENTS,
    PIPELINE_REPORT,
    pipeline_report,
    publish_pipeline_run,
)

import meshforge.cli.spark_job
from meshforge.transport.server import EmbeddedServer
from polling import wait_until_sync

pytestmark = [pytest.mark.spark, pytest.mark.slow]

BIN = Path(sys.executable).parent


# What the master logs once bound (it is given port 0: a port picked here could be taken).
_MASTER_AT = re.compile(r"Starting Spark master at (spark://\S+)")
_MASTER_UI_AT = re.compile(r"Bound MasterWebUI to .*? and started at (http://\S+)")


@dataclass
class Standalone:
    """A running standalone master and worker; ``url`` is the master's ``spark://``."""

    url: str
    ui: str
    work_dir: Path

    def state(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"{self.ui}/json/", timeout=2) as resp:
                data = json.loads(resp.read())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the daemon's process group (its executors too), SIGKILL if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # executors the worker left behind


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[Standalone]:
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(tmp_path / "logs"),
           "SPARK_WORKER_DIR": str(tmp_path / "work"), "PYSPARK_PYTHON": sys.executable}  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []

    def launch(name: str, *args: str) -> None:
        log = (tmp_path / f"{name}.log").open("wb")
        procs.append(subprocess.Popen([str(BIN / "spark-class"), *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        log.close()

    try:
        launch("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
               "--port", "0", "--webui-port", "0")  # fmt: skip
        bound: list[str] = []

        def master_bound() -> bool:
            if procs[0].poll() is not None:
                log = (tmp_path / "master.log").read_text()[-2000:]
                raise AssertionError(f"the Spark master exited: {log}")
            said = (tmp_path / "master.log").read_text(errors="replace")
            found = [m.group(1) for m in (_MASTER_AT.search(said), _MASTER_UI_AT.search(said)) if m]
            bound[:] = found
            return len(found) == 2

        wait_until_sync(master_bound, 60, "the Spark master's URL and web UI in its log")
        cluster = Standalone(bound[0], bound[1].rstrip("/"), tmp_path / "work")
        launch("worker", "org.apache.spark.deploy.worker.Worker", cluster.url, "--host", "127.0.0.1",
               "--cores", "1", "--memory", "1g", "--webui-port", "0",
               "--work-dir", str(cluster.work_dir))  # fmt: skip

        def worker_alive() -> bool:
            for proc, name in zip(procs, ("master", "worker"), strict=True):
                if proc.poll() is not None:
                    log = (tmp_path / f"{name}.log").read_text()[-2000:]
                    raise AssertionError(f"the Spark {name} exited: {log}")
            return cluster.state().get("aliveworkers") == 1

        wait_until_sync(worker_alive, 60, "the standalone worker to register with the master")
        yield cluster
    finally:
        for proc in reversed(procs):
            _stop(proc)


def _submit(master: str, cwd: Path, *args: str) -> str:
    """``spark-submit --master MASTER job.py ARGS`` as PIPELINE.md shows it; the output."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1",
           "MESHFORGE_HOME": str(cwd / "home")}  # fmt: skip
    env.pop("PYSPARK_GATEWAY_PORT", None)
    done = subprocess.run(
        [str(BIN / "spark-submit"), "--master", master, "--conf", "spark.ui.enabled=false",
         "--conf", "spark.executor.memory=512m",
         # the executors compile as the tests' other JVMs do (tests/conftest.py)
         "--conf", f"spark.executor.extraJavaOptions={os.environ.get('SPARK_SUBMIT_OPTS', '')}",
         meshforge.cli.spark_job.__file__, *args],
        env=env, capture_output=True, text=True, timeout=450, cwd=cwd,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    return said


# A bound against a hang, not a speed test: JVMs of its own beside the suite's other
# workers on 2 cores took 300 s (alone, about 130 s).
@pytest.mark.timeout(900)
async def test_ingest_and_audit_on_a_standalone_cluster_equal_local_mode(
    standalone: Standalone, private_server: EmbeddedServer, tmp_path: Path
) -> None:
    url = private_server.url
    await publish_pipeline_run(url)

    # on the cluster, through spark-submit and job.py
    remote = tmp_path / "remote"
    said = _submit(standalone.url, tmp_path, "ingest", "--nats-url", url, "--output", str(remote))
    assert (
        f"MESHFORGE_EVENTS: {EVENTS} new rows" in said
        and f"MESHFORGE_FAILED: {DEAD_LETTERS} new rows" in said
    )
    said = _submit(standalone.url, tmp_path, "audit", "--output", str(remote))
    assert "exactly-once holds" in said, said[-3000:]
    # the tasks ran in executors of the standalone worker, not in the driver
    apps = standalone.state().get("completedapps") or []
    assert len(apps) == 2 and all(a.get("state") == "FINISHED" for a in apps), apps
    assert len(list(standalone.work_dir.glob("app-*/*/stderr"))) >= 2

    assert pipeline_report(remote) == PIPELINE_REPORT  # what local mode gives (test_cli.py)
    counts = [pq.ParquetDataset(remote / name).read().num_rows for name in ("events", "failed")]
    assert counts == [EVENTS, DEAD_LETTERS]
