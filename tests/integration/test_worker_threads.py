"""A worker lets its store threads have the GIL back quickly: each SQL statement gives it up."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from test_engine_support import ledger_agent, open_store_async, running, settings_for

from meshforge.runtime.worker import SWITCH_INTERVAL, quick_thread_switches


@pytest.fixture
def switch_interval() -> Iterator[None]:
    """The interpreter's default interval for the test, and the one before it afterwards."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@pytest.mark.usefixtures("switch_interval")
async def test_a_running_worker_switches_threads_within_half_a_millisecond(nats_url: str, sqlite_url: str) -> None:
    store = await open_store_async(sqlite_url)
    try:
        async with running([ledger_agent()], settings_for(nats_url, sqlite_url), store=store):
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL) == 0.0005
    finally:
        store.close()


@pytest.mark.usefixtures("switch_interval")
def test_a_program_that_chose_its_own_switch_interval_keeps_it() -> None:
    sys.setswitchinterval(0.002)
    quick_thread_switches()
    assert sys.getswitchinterval() == pytest.approx(0.002)
