"""``meshforge.spark.register`` names the interpreter when Spark's workers cannot import MeshForge."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from meshforge.errors import ConfigError
from meshforge.spark import _check_local_workers


def _session(master: str, python: str) -> Any:
    return SimpleNamespace(sparkContext=SimpleNamespace(master=master, pythonExec=python))


def test_a_worker_interpreter_without_meshforge_is_one_clear_error(tmp_path: Path) -> None:
    other = tmp_path / "python3"
    other.write_text("#!/bin/sh\necho \"No module named 'meshforge'\" >&2\nexit 1\n")
    other.chmod(0o755)
    with pytest.raises(ConfigError, match="PYSPARK_PYTHON") as caught:
        _check_local_workers(_session("local[2]", str(other)))
    assert str(other) in str(caught.value) and "\n" not in str(caught.value)


def test_the_same_interpreter_and_cluster_masters_pass() -> None:
    _check_local_workers(_session("local[2]", sys.executable))
    _check_local_workers(_session("spark://127.0.0.1:7077", "/no/such/python"))
