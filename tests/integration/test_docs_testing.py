"""docs/TESTING.md's complete test file runs and passes, with the plugin as installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_test_file_passes(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "TESTING.md").read_text()
    [code] = re.findall(r"```python\n# test_orders.py\n(.*?)```", doc, re.S)
    (tmp_path / "test_orders.py").write_text(code)
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHFORGE_", "PYTEST_"))}
    env["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "meshforge.testing.plugin", "-p", "no:cacheprovider"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout
