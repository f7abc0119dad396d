"""The benchmark harness itself: the runner reports failures, the load generator keeps its
schedule honest, and every baseline drains a backlog on a real nats-server."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg

from meshforge.envelope import decode

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))


def bench_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")]),
    }


def test_run_all_shows_a_failed_script_as_failed_and_runs_it_once(tmp_path: Path) -> None:
    for name in ("run_all.py", "_floors.py"):
        shutil.copy(BENCH / name, tmp_path / name)
    runs = tmp_path / "runs"
    (tmp_path / "bench_agent.py").write_text(
        "import sys\n"
        "sys.path.insert(0, '.')\n"
        "from _floors import floor\n"
        f"open({str(runs)!r}, 'a').write('run\\n')\n"
        "floor('F1', 'a figure printed before it failed', '1.50x', '>= 1.0x', met=True)\n"
        "raise SystemExit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "run_all.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=bench_env(),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert runs.read_text().count("run") == 1, "a failed benchmark must not be rerun"
    rows = {
        line.split()[0]: line
        for line in done.stdout.splitlines()
        if line.split()[:1] in (["F1"], ["F2"], ["F4"])
    }
    assert "FAILED" in rows["F1"] and "exited with 3" in rows["F1"]
    assert "FAILED" in rows["F2"] and "FAILED" in rows["F4"]
    assert "bench_agent.py (exit 3)" in done.stdout


async def test_load_stamps_each_command_with_its_due_time_and_prints_its_lag(nats_url: str) -> None:
    rate, seconds = 200, 1.0
    nc = await nats.connect(nats_url)
    stamps: list[float] = []

    async def take(msg: Msg) -> None:
        stamps.append(decode(msg.data, msg.headers).payload["t"])

    await nc.subscribe("bench.load.due", cb=take)
    await nc.flush()
    gen = await asyncio.create_subprocess_exec(
        sys.executable, str(BENCH / "_variants.py"), "load", nats_url, "bench.load.due", str(rate), str(seconds), "16",
        env=bench_env(), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(gen.communicate(), 30)
    await nc.flush()
    await nc.close()
    assert gen.returncode == 0
    assert len(stamps) == int(rate * seconds)
    # Stamps from the schedule, not the clock at sending: exactly 1/rate apart.
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    assert max(abs(step - 1 / rate) for step in steps) < 1e-6
    lag = json.loads(
        next(line for line in out.decode().splitlines() if line.startswith("@lag "))[5:]
    )
    assert set(lag) == {"p50", "p99", "max"} and lag["max"] >= lag["p99"] >= lag["p50"]


@pytest.mark.parametrize("kind", ["raw", "raw-serial", "fs", "fs-workers"])
async def test_each_baseline_drains_a_backlog(kind: str, tmp_path: Path) -> None:
    from _agents import bench, count_outputs
    from _variants import command_body

    from meshforge.envelope import Outbound
    from meshforge.publish.publisher import Publisher

    n = 600
    async with bench(kind, tmp_path) as b:
        inp, _ = b.subjects
        await Publisher(b.nc.jetstream()).publish_many(
            [Outbound.of(inp, command_body("x" * 16)) for _ in range(n)]
        )
        b.start()
        first, last = await count_outputs(b, n, 60)
        assert last >= first
        info = await b.nc.jetstream().consumer_info("BENCH_IN", "bench")
        assert info.num_pending == 0


async def test_the_typed_payload_benchmark_prints_both_floors(tmp_path: Path) -> None:
    done = await asyncio.create_subprocess_exec(
        sys.executable, str(BENCH / "bench_typed.py"), "--n", "300", "--rounds", "1",
        "--step-n", "200", "--step-rounds", "3",
        env=bench_env(), cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(done.communicate(), 240)
    text = out.decode()
    assert done.returncode == 0, text[-3000:]
    floors = [
        json.loads(line[len("@floor ") :])
        for line in text.splitlines()
        if line.startswith("@floor ")
    ]
    assert [f["id"] for f in floors] == ["T1", "T2"], text[-3000:]
    assert all(f["target"] == ">= 0.95x" and f["value"].endswith("x") for f in floors)
    assert "typed: Command.of" in text and "MeshForge agent, payload declared as a Struct" in text
