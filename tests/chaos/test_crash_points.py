"""The crash suite: a worker killed with SIGKILL at every named crash point, and at random
moments under load, again and again; checked from outside that every command had exactly
one effect, every output was published, and nothing was lost.

``make test`` runs 12 kills per crash point and 12 random-time kills; ``CHAOS_SCALE``
(``make chaos`` sets 20) multiplies them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from crash_harness import crash_point_run, random_kill_run, scale

from meshforge.ops.faults import CRASH_POINTS

pytestmark = pytest.mark.slow

KILLS = 12


@pytest.mark.parametrize("point", CRASH_POINTS)
async def test_kills_at_a_crash_point_leave_exactly_one_effect(tmp_path: Path, point: str) -> None:
    result = await crash_point_run(tmp_path, point, KILLS * scale(), seed=CRASH_POINTS.index(point))
    assert result["kills"] >= KILLS * scale()
    assert result["commands"] > 0


async def test_random_kills_under_load_leave_exactly_one_effect(tmp_path: Path) -> None:
    result = await random_kill_run(tmp_path, KILLS * scale())
    assert result["kills"] >= KILLS * scale()
