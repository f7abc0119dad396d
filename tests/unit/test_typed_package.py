"""The package ships ``py.typed`` (PEP 561), so users' type checkers read its annotations."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_built_wheel_and_sdist_carry_py_typed(tmp_path: Path) -> None:
    """Built by the project's own build backend (hatchling), as a release would be."""
    done = subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "--directory", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = tmp_path.glob("meshforge-*.whl")
    with zipfile.ZipFile(wheel) as built:
        assert "meshforge/py.typed" in built.namelist()
    (sdist,) = tmp_path.glob("meshforge-*.tar.gz")
    with tarfile.open(sdist) as built:
        assert any(name.endswith("/src/meshforge/py.typed") for name in built.getnames())
