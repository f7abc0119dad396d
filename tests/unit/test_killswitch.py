"""The kill switch alone: one line to open, one to close, a bounded reminder, the gauge."""

from __future__ import annotations

import asyncio
import logging

import pytest

from meshforge.errors import StoreError
from meshforge.ops.observability import Metrics
from meshforge.runtime.killswitch import KillSwitch, is_outage
from polling import wait_until

DISK_FULL = StoreError(
    "sqlite store: OperationalError: database or disk is full", kind="unavailable", retriable=True
)


def gauge(metrics: Metrics, cause: str) -> float:
    value = metrics.registry.get_sample_value("meshforge_kill_switch_open", {"cause": cause})
    assert value is not None
    return value


async def test_open_and_close_say_one_line_each_and_set_the_gauge(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="meshforge.killswitch")
    metrics = Metrics()
    switch = KillSwitch(metrics)
    assert not switch.paused and gauge(metrics, "store") == 0
    for _ in range(100):  # every probe that fails says so again: still one line
        switch.open("store", DISK_FULL)
    assert switch.paused and switch.causes == ["store"] and gauge(metrics, "store") == 1
    resumed = asyncio.ensure_future(switch.resumed())
    await asyncio.sleep(0)  # let it start waiting
    assert not resumed.done()
    switch.close("server")  # not what holds it open
    assert switch.paused
    switch.close("store")
    await asyncio.wait_for(resumed, 1)
    assert not switch.paused and gauge(metrics, "store") == 0
    assert [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records] == [
        ("ERROR", "kill switch open"), ("ERROR", "kill switch closed"),
    ]  # fmt: skip
    assert "database or disk is full" in caplog.records[0].getMessage()
    trips = metrics.registry.get_sample_value(
        "meshforge_kill_switch_trips_total", {"cause": "store"}
    )
    assert trips == 1


async def test_a_long_outage_is_recalled_at_most_once_a_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="meshforge.killswitch")
    switch = KillSwitch(Metrics(), remind_every=0.2)
    switch.open("store", DISK_FULL)

    def reminders() -> int:
        return sum(1 for r in caplog.records if "still open" in r.getMessage())

    await wait_until(lambda: reminders() >= 2, timeout=5, what="two reminders")
    switch.close("store")
    count = reminders()
    await asyncio.sleep(0.5)  # a closed switch reminds no more
    assert reminders() == count


def test_only_unavailable_store_errors_are_outages() -> None:
    assert is_outage(DISK_FULL)
    assert not is_outage(StoreError("NUL in text", kind="invalid"))
    assert not is_outage(StoreError("could not serialize", kind="conflict", retriable=True))
    assert not is_outage(RuntimeError("database or disk is full"))
