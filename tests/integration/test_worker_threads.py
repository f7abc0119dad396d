"""Threads of a worker: its store threads have the GIL back quickly (each SQL statement
gives it up), and a light load's transactions run on the event loop's own thread."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import msgspec
import pytest
from test_engine_support import (
    events_of,
    ledger_agent,
    open_conn,
    open_store_async,
    running,
    send,
    settings_for,
    wait_until,
)

from meshforge.envelope import Envelope
from meshforge.runtime.agent import Agent, Event, Output, command
from meshforge.runtime.worker import SWITCH_INTERVAL, quick_thread_switches
from meshforge.transport.connection import Connection


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
async def test_a_running_worker_switches_threads_within_half_a_millisecond(
    nats_url: str, sqlite_url: str
) -> None:
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


class Count(msgspec.Struct):
    n: int = 0


def tally_agent() -> Agent[Count]:
    """Plain-function handler; ``add {"id", "block"?}`` notes the thread it ran on and
    blocks that thread ``block`` seconds (a handler doing blocking I/O)."""

    class Tally(Agent[Count]):
        name = f"tal{uuid.uuid4().hex[:8]}"
        threads: list[str] = []

        @command("add", key="id")
        def add(self, cmd: Envelope, state: Count) -> list[Output]:
            self.threads.append(threading.current_thread().name)
            time.sleep(float(cmd.payload.get("block", 0)))
            return [Event("added", {"id": cmd.payload["id"]})]

        def apply(self, state: Count, event: Event) -> Count:
            return Count(state.n + 1)

    return Tally()


async def test_a_light_load_commits_on_the_event_loop_until_a_handler_blocks_it(
    nats_url: str, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    agent = tally_agent()
    loop_thread = threading.current_thread().name
    store = await open_store_async(sqlite_url)
    conn = await open_conn(settings_for(nats_url, sqlite_url))
    try:
        async with running([agent], settings_for(nats_url, sqlite_url), store=store):
            sent = 0

            async def one(block: float) -> str:
                """One command at a time (a light load): the thread its handler ran on."""
                nonlocal sent
                await send(conn, agent.name, "add", {"id": f"r{sent}", "block": block})
                sent += 1
                await wait_until(lambda n=sent: _events(conn, agent.name, n), what=f"event {sent}")
                return agent.threads[-1]  # type: ignore[attr-defined,no-any-return]

            def blocked() -> bool:
                return any("handlers took" in r.getMessage() and "store thread from now on" in r.getMessage()
                           for r in caplog.records if r.name == "meshforge.engine")  # fmt: skip

            # On the loop's own thread (a loaded machine may send one to the store thread
            # while the store is busy: the next goes to the loop again) ...
            assert loop_thread in [await one(0) for _ in range(3)]
            # ... until a handler blocks the loop (50 ms); a loaded machine may send a few of
            # them to the store thread first, where they block nothing ...
            for _ in range(20):
                if await one(0.05) == loop_thread:
                    break
            assert blocked(), [r.getMessage() for r in caplog.records]
            # ... then in the store thread for good.
            later = [await one(0), await one(0)]
        assert all(t.startswith(f"meshforge-{agent.name}-store") for t in later), later
        assert len(await events_of(conn, agent.name)) == sent
    finally:
        await conn.close()
        store.close()


async def _events(conn: Connection, agent: str, count: int) -> bool:
    return len(await events_of(conn, agent)) >= count


def test_freezing_the_start_up_heap_leaves_a_full_collection_little_to_walk() -> None:
    # In a process of its own: what is frozen stays frozen for the process's life.
    script = (
        "import gc, time, meshforge.cli, meshforge.runtime.worker as w\n"
        "def full():\n"
        "    t = time.perf_counter(); gc.collect(); return time.perf_counter() - t\n"
        "before = min(full() for _ in range(3))\n"
        "w.freeze_start_up_heap()\n"
        "after = min(full() for _ in range(3))\n"
        "print(gc.get_freeze_count(), before, after)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    frozen, before, after = out.stdout.split()
    assert int(frozen) > 10_000
    assert float(after) < float(before) / 3
