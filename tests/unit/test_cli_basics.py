"""What every command shares: --version, -h, and one exit-code convention (0, 1, 2)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from meshforge.cli import app


def _meshforge(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshforge", *args],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip


def test_version_and_short_help() -> None:
    out = CliRunner().invoke(app, ["--version"])
    assert out.exit_code == 0 and out.stdout.strip() == f"meshforge {version('meshforge')}"
    for args in (["-h"], ["dlq", "-h"], ["ctl", "send", "-h"]):
        shown = CliRunner().invoke(app, args)
        assert shown.exit_code == 0 and "Usage:" in shown.stdout, args


@pytest.mark.parametrize(
    "args",
    [
        ["publish", "cmd.a.b.c.d", "{oops"],
        ["no-such-command"],
        ["ctl", "send", "s", "n", "x", "[1]"],
    ],
)
def test_usage_errors_exit_2_with_one_error_line(args: list[str]) -> None:
    done = _meshforge(*args)
    assert done.returncode == 2, done.stderr
    assert len([line for line in done.stderr.splitlines() if line.startswith("Error:")]) == 1
    assert "Traceback" not in done.stderr


def test_a_bad_setting_is_a_usage_error() -> None:
    import os

    env = {**os.environ, "MESHFORGE_NATS_URL": "http://127.0.0.1:1"}
    done = _meshforge("publish", "cmd.a.b.c.d", "{}", env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and len(done.stderr.strip().splitlines()) == 1
