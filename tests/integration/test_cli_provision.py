from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.js import JetStreamContext
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.errors import OverlapError

NAMES = [
    "MESHFORGE_COMMANDS",
    "MESHFORGE_EVENTS",
    "MESHFORGE_FAILED",
    "MESHFORGE_CONTROL",
    "MESHFORGE_REPLIES",
]
# Wide output so table rows stay on one line; no settings leak in from the caller's shell.
ENV = {"COLUMNS": "250", "MESHFORGE_NATS_URL": None, "MESHFORGE_CONFIG": None}


@pytest.fixture
async def empty_js(clean_js: JetStreamContext) -> AsyncIterator[JetStreamContext]:
    """An empty server, emptied again afterwards so no test here leaves streams for others."""
    yield clean_js
    for info in await clean_js.streams_info():
        await clean_js.delete_stream(info.config.name)


def add_other_stream(url: str) -> None:
    """A stream not owned by MeshForge that captures the events' subjects."""

    async def add() -> None:
        nc = await nats.connect(url)
        await nc.jetstream().add_stream(name="OTHER", subjects=["evt.>"])
        await nc.close()

    asyncio.run(add())


def run(*args: str, **env: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, ["provision", *args], env={**ENV, **env})


def server_topology(url: str) -> dict[str, list[str]]:
    """Stream name -> consumer names, read through a connection of its own."""

    async def read() -> dict[str, list[str]]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            return {
                info.config.name: sorted(c.name for c in await js.consumers_info(info.config.name))
                for info in await js.streams_info()
            }
        finally:
            await nc.close()

    return asyncio.run(read())


def test_dry_run_on_empty_server_lists_five_streams_and_creates_nothing(
    empty_js: JetStreamContext, nats_url: str
) -> None:
    result = run("--nats-url", nats_url, "--dry-run")
    assert result.exit_code == 0, result.output
    for name in NAMES:
        assert name in result.output
    assert result.output.count("create") == 5
    assert "dry run: 5 change(s) planned, nothing applied" in result.output
    assert server_topology(nats_url) == {}


def test_provision_twice_reports_no_changes_the_second_time(
    empty_js: JetStreamContext, nats_url: str
) -> None:
    args = [
        "--nats-url",
        nats_url,
        "--agent",
        "order",
        "--agent",
        "inventory",
        "--site",
        "lab1",
        "--node",
        "node7",
    ]
    first = run(*args)
    assert first.exit_code == 0, first.output
    assert "applied 8 change(s)" in first.output
    second = run(*args)
    assert second.exit_code == 0, second.output
    assert "no changes" in second.output
    assert "create" not in second.output and second.output.count("unchanged") == 8
    topology = server_topology(nats_url)
    # With a node, the presence bucket its node announces itself in (a KV stream).
    assert "presence bucket MESHFORGE_NODES ready" in first.output
    assert sorted(topology) == sorted([*NAMES, "KV_MESHFORGE_NODES"])
    assert topology["MESHFORGE_COMMANDS"] == ["inventory_consumer", "order_consumer"]
    assert topology["MESHFORGE_CONTROL"] == ["node_lab1_node7"]


def test_changed_setting_is_shown_as_a_diff_and_applied(
    empty_js: JetStreamContext, nats_url: str
) -> None:
    assert run("--nats-url", nats_url).exit_code == 0
    dry = run("--nats-url", nats_url, "--dry-run", MESHFORGE_MAX_AGE="2d")
    assert dry.output.count("max_age unlimited -> 2d") == 5
    assert "dry run: 5 change(s)" in dry.output
    applied = run("--nats-url", nats_url, MESHFORGE_MAX_AGE="2d")
    assert "applied 5 change(s)" in applied.output
    assert "no changes" in run("--nats-url", nats_url, MESHFORGE_MAX_AGE="2d").output


def test_overlap_is_refused_and_exits_non_zero(empty_js: JetStreamContext, nats_url: str) -> None:
    add_other_stream(nats_url)
    result = run("--nats-url", nats_url)
    assert result.exit_code == 1
    assert isinstance(result.exception, OverlapError)
    assert "OTHER" in str(result.exception) and "MESHFORGE_EVENTS" in str(result.exception)
    assert "refused" in result.output
    assert list(server_topology(nats_url)) == ["OTHER"]  # nothing was created
    dry = run("--nats-url", nats_url, "--dry-run")
    assert dry.exit_code == 1 and isinstance(dry.exception, OverlapError)


def test_refusal_through_the_real_program_is_one_error_line(
    empty_js: JetStreamContext, nats_url: str
) -> None:
    add_other_stream(nats_url)
    env = {
        k: v for k, v in os.environ.items() if k not in ("MESHFORGE_NATS_URL", "MESHFORGE_CONFIG")
    }
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from meshforge.cli import main; main()",
            "provision",
            "--nats-url",
            nats_url,
        ],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "250"},
        timeout=60,
    )
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "OTHER" in errors[0] and "MESHFORGE_EVENTS" in errors[0]


def test_bad_node_is_a_usage_error(nats_url: str) -> None:
    result = run("--nats-url", nats_url, "--node", "node7")
    assert result.exit_code == 2
    assert "--site SITE --node node7" in result.output


def test_without_url_uses_an_embedded_server_under_dot_meshforge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = run("--dry-run")
    assert result.exit_code == 0, result.output
    assert result.output.count("create") == 5
    assert (tmp_path / ".meshforge" / "nats").is_dir()
