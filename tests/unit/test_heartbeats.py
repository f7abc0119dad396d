"""The in-progress heartbeat: one task for every held handler, each beaten within its period."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

from meshforge.consume.ack import Heartbeats
from polling import wait_until


class Beaten:
    """Stands in for a message: records when ``in_progress`` was sent for it."""

    def __init__(self) -> None:
        self.taken = time.monotonic()
        self.beats: list[float] = []

    async def in_progress(self) -> None:
        self.beats.append(time.monotonic() - self.taken)


async def test_a_short_period_held_after_a_long_one_is_beaten_in_time() -> None:
    heartbeats = Heartbeats()
    slow, quick = Beaten(), Beaten()
    heartbeats.hold(cast(Any, [slow]), 60.0)
    await asyncio.sleep(0)  # one loop turn: the task starts its 30 s sleep
    key = heartbeats.hold(cast(Any, [quick]), 0.2)
    await wait_until(lambda: len(quick.beats) >= 3, timeout=10, what="three beats of the quick one")
    # due within 1.5 periods (0.3 s); 5x that for a loaded machine, far below the 30 s sleep
    assert quick.beats[0] <= 1.5, quick.beats
    assert not slow.beats  # not due yet
    heartbeats.release(key)


async def test_releasing_everything_ends_the_task_at_its_next_round() -> None:
    heartbeats = Heartbeats()
    held = Beaten()
    key = heartbeats.hold(cast(Any, [held]), 0.05)
    await wait_until(lambda: bool(held.beats), timeout=2, what="a beat")
    task = heartbeats._task
    assert task is not None
    heartbeats.release(key)
    beats = len(held.beats)
    await asyncio.wait_for(task, 1)  # ends by itself: nothing held when it wakes
    assert task.done() and not task.cancelled()
    assert len(held.beats) == beats  # nothing beaten after the release


async def test_a_hold_after_the_task_ended_starts_another() -> None:
    heartbeats = Heartbeats()
    first, second = Beaten(), Beaten()
    heartbeats.release(heartbeats.hold(cast(Any, [first]), 0.05))
    task = heartbeats._task
    assert task is not None
    await asyncio.wait_for(task, 1)
    key = heartbeats.hold(cast(Any, [second]), 0.05)
    await wait_until(lambda: bool(second.beats), timeout=2, what="a beat of the second hold")
    assert not first.beats
    heartbeats.release(key)
