"""The crash suite: a worker killed with SIGKILL at every named crash point, and at random
moments under load, again and again; checked from outside that every command had exactly
one effect, every output was published, and nothing was lost.

``make test`` runs 4 kills per crash point and 4 random-time kills, each run on a workload
of its own; ``make chaos`` (``CHAOS_SCALE=20``) runs 240 of each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from crash_harness import crash_point_run, random_kill_run, scale

from meshforge.ops.faults import CRASH_POINTS

pytestmark = pytest.mark.slow


def kills() -> int:
    """4 in ``make test`` (a bounded run of every point); 12 times CHAOS_SCALE in chaos."""
    return 4 if scale() == 1 else 12 * scale()


@pytest.mark.parametrize("point", CRASH_POINTS)
async def test_kills_at_a_crash_point_leave_exactly_one_effect(tmp_path: Path, point: str) -> None:
    result = await crash_point_run(tmp_path, point, kills(), seed=CRASH_POINTS.index(point))
    assert result["kills"] >= kills()
    assert result["commands"] > 0


async def test_random_kills_under_load_leave_exactly_one_effect(tmp_path: Path) -> None:
    result = await random_kill_run(tmp_path, kills())
    assert result["kills"] >= kills()
