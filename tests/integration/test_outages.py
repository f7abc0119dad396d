"""Outages of our own pause the work, never dead-letter it: disk full, a read-only store,
PostgreSQL stopped. Each ends with every command applied once, no dead letter, and a
bounded log (issue 24)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import DiscardPolicy
from outage_support import (
    PrivatePostgres,
    all_applied_once,
    blob_agent,
    fill,
    outage_lines,
    small_disk,
    switch_lines,
)
from test_engine_support import (
    events_of,
    open_conn,
    open_store_async,
    running,
    send_many,
    settings_for,
    wait_until,
)

from meshforge.config import Settings
from meshforge.envelope import Envelope
from meshforge.runtime.worker import Worker
from meshforge.topology.subjects import STREAM_EVENTS
from meshforge.transport.connection import Connection
from meshforge.transport.server import EmbeddedServer

# The settings of every outage here: short, so an outage of a few seconds outlasts them.
# The first backoff entry is a delivery's first ack wait (the server's, whatever ack_wait
# says): a second, so the held commands' beats (every third of it) still arrive in time on
# a machine whose CPU quota stalls the process a few hundred milliseconds. At 0.2 s, a CI
# run saw 50 held commands handed out again; the test process stopped for 0.25 s every
# 1.5 s (SIGSTOP) does the same, and passes at 1 s.
ACK_WAIT, BACKOFF, MAX_DELIVER = 2.0, (1.0, 0.5, 0.5), 4


def commands(agent: str, n: int, pad: int = 0) -> list[tuple[str, Envelope]]:
    return [
        (f"cmd.default.test.{agent}.put",
         Envelope.new(f"{agent}.put", {"id": uuid.uuid4().hex, "pad": "x" * pad}, source="test"))
        for _ in range(n)
    ]  # fmt: skip


def redeliveries(worker: Worker, agent: str) -> float:
    """Deliveries of the agent's commands past their first, as the worker counted them."""
    value = worker.metrics.registry.get_sample_value(
        "meshforge_redeliveries_total", {"consumer": f"{agent}_consumer"}
    )
    return value or 0.0


def outlasts(settings: Settings) -> float:
    """An outage longer than every delivery the settings allow a command, delays included
    (the server's doubling of nak delays too): on the old code all of them were used up."""
    return settings.max_deliver * settings.ack_wait + 2 * sum(settings.backoff) + 2.0


async def hold_open(worker: Worker, seconds: float) -> list[str]:
    """The outage lasts ``seconds`` from now (it began with the first command sent into
    it); returns what was wrong meanwhile: the worker must pause and say it is unready
    from its first failure on."""
    wrong: list[str] = []
    opened = False
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        paused = bool(getattr(worker, "kill_switch", None) and worker.kill_switch.paused)
        opened = opened or paused
        if opened and not paused:
            wrong.append("the kill switch closed during the outage")
        if opened and worker.is_ready():
            wrong.append("/readyz true during the outage")
        await asyncio.sleep(0.1)  # the outage's own duration, checked as it goes
    if not opened:
        wrong.append("the kill switch never opened")
    return sorted(set(wrong))


async def _applied(conn: Connection, agent: str, n: int) -> bool:
    return len(await events_of(conn, agent)) >= n


async def test_disk_full_under_sqlite_pauses_and_resumes_without_dead_letters(
    nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="meshforge")
    agent = blob_agent()
    with small_disk(tmp_path / "disk") as disk:
        url = f"sqlite:///{disk}/store.db"
        settings = settings_for(
            nats_url, url, ack_wait=ACK_WAIT, backoff=BACKOFF, max_deliver=MAX_DELIVER
        )
        conn = await open_conn(settings)
        store = await open_store_async(url)
        try:
            async with running([agent], settings, store=store) as worker:
                first = commands(agent.name, 10)
                await send_many(conn, first)
                await all_applied_once(conn, agent.name, [e.id for _, e in first])
                ballast = fill(disk)
                rest = commands(agent.name, 60, pad=16_384)  # a few MiB: more than any free page
                await send_many(conn, rest)
                wrong = await hold_open(worker, outlasts(settings))
                ballast.unlink()  # space is back
                back = time.monotonic()
                await all_applied_once(conn, agent.name, [e.id for _, e in first + rest])
                resumed = time.monotonic() - back
                assert (
                    redeliveries(worker, agent.name) == 0
                )  # held, not handed back: no delivery counted
                await wait_until(lambda: worker.is_ready(), within=10, what="/readyz true again")
        finally:
            store.close()
            await conn.close()
    assert_quiet_pause(wrong, resumed, caplog.records)


async def test_postgresql_stopped_pauses_and_resumes_without_dead_letters(
    nats_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="meshforge")
    pg = PrivatePostgres()
    await asyncio.to_thread(pg.init)
    agent = blob_agent()
    settings = settings_for(
        nats_url, pg.url, ack_wait=ACK_WAIT, backoff=BACKOFF, max_deliver=MAX_DELIVER
    )
    conn = await open_conn(settings)
    store = await open_store_async(pg.url)
    try:
        async with running([agent], settings, store=store) as worker:
            first = commands(agent.name, 200)
            await send_many(conn, first)
            await wait_until(
                lambda: _applied(conn, agent.name, 20), within=20, what="the first commands applied"
            )
            await asyncio.to_thread(pg.stop, "immediate")  # under load, as a crash would
            rest = commands(agent.name, 100)
            await send_many(conn, rest)
            wrong = await hold_open(worker, outlasts(settings))
            await asyncio.to_thread(pg.start)
            back = time.monotonic()
            await all_applied_once(conn, agent.name, [e.id for _, e in first + rest])
            resumed = time.monotonic() - back
            assert (
                redeliveries(worker, agent.name) == 0
            )  # held, not handed back: no delivery counted
            await wait_until(lambda: worker.is_ready(), within=10, what="/readyz true again")
    finally:
        store.close()
        await conn.close()
        await asyncio.to_thread(pg.remove)
    assert_quiet_pause(wrong, resumed, caplog.records)


async def test_read_only_store_pauses_and_resumes_without_dead_letters(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL turned read-only (as a standby is) for longer than every delivery."""
    caplog.set_level(logging.INFO, logger="meshforge")
    pg = PrivatePostgres()
    await asyncio.to_thread(pg.init)
    agent = blob_agent()
    settings = settings_for(
        nats_url, pg.url, ack_wait=ACK_WAIT, backoff=BACKOFF, max_deliver=MAX_DELIVER
    )
    conn = await open_conn(settings)
    store = await open_store_async(pg.url)
    try:
        async with running([agent], settings, store=store) as worker:
            first = commands(agent.name, 10)
            await send_many(conn, first)
            await all_applied_once(conn, agent.name, [e.id for _, e in first])
            await asyncio.to_thread(pg.read_only, True)
            rest = commands(agent.name, 30)
            await send_many(conn, rest)
            wrong = await hold_open(worker, outlasts(settings))
            await asyncio.to_thread(pg.read_only, False)
            back = time.monotonic()
            await all_applied_once(conn, agent.name, [e.id for _, e in first + rest])
            resumed = time.monotonic() - back
            assert (
                redeliveries(worker, agent.name) == 0
            )  # held, not handed back: no delivery counted
    finally:
        store.close()
        await conn.close()
        await asyncio.to_thread(pg.remove)
    assert_quiet_pause(wrong, resumed, caplog.records)


async def test_nats_server_killed_pauses_and_resumes_without_dead_letters(
    private_server: EmbeddedServer, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """nats-server SIGKILLed under load, down longer than every delivery, restarted."""
    caplog.set_level(logging.INFO, logger="meshforge")
    agent = blob_agent()
    settings = settings_for(private_server.url, sqlite_url, ack_wait=ACK_WAIT, backoff=BACKOFF,
                            max_deliver=MAX_DELIVER, publish_attempts=2, publish_backoff_cap=0.2)  # fmt: skip
    conn = await open_conn(settings)
    try:
        async with running([agent], settings) as worker:
            first = commands(agent.name, 400)
            await send_many(conn, first)
            await wait_until(
                lambda: _applied(conn, agent.name, 50), within=20, what="the first commands applied"
            )
            await asyncio.to_thread(private_server.kill)
            wrong = await hold_open(worker, outlasts(settings))
            await asyncio.to_thread(private_server.start)
            back = time.monotonic()
            rest = commands(agent.name, 50)
            await wait_until(
                lambda: conn.current_state() == "connected", within=20, what="the test reconnected"
            )
            await send_many(conn, rest)
            await all_applied_once(conn, agent.name, [e.id for _, e in first + rest])
            resumed = time.monotonic() - back
            await wait_until(lambda: worker.is_ready(), within=10, what="/readyz true again")
    finally:
        await conn.close()
    assert wrong == []
    print(f"resumed {resumed:.1f}s after the outage ended")  # the figure docs/OPERATIONS.md quotes
    assert resumed < 15, f"resumed {resumed:.1f}s after the outage ended"
    opened = switch_lines(caplog.records)
    assert opened[:2] == ["kill switch open", "kill switch closed"] and len(opened) <= 4, opened
    lines = outage_lines(caplog.records)
    assert (
        lines.get("CRITICAL", 0) == 0
        and lines.get("WARNING", 0) <= 10
        and lines.get("ERROR", 0) <= 4
    ), lines


async def test_publishing_refused_for_every_output_pauses_and_resumes_without_dead_letters(
    private_server: EmbeddedServer, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The events stream full (discard new): every publish fails, whatever the command."""
    caplog.set_level(logging.INFO, logger="meshforge")
    agent = blob_agent()
    settings = settings_for(private_server.url, sqlite_url, ack_wait=ACK_WAIT, backoff=BACKOFF,
                            max_deliver=MAX_DELIVER, publish_attempts=2, publish_backoff_cap=0.2)  # fmt: skip
    conn = await open_conn(settings)
    try:
        async with running([agent], settings) as worker:
            first = commands(agent.name, 5)
            await send_many(conn, first)
            await all_applied_once(conn, agent.name, [e.id for _, e in first])
            info = await conn.js.stream_info(STREAM_EVENTS)
            full = replace(info.config, discard=DiscardPolicy.NEW, max_msgs=info.state.messages)
            await conn.js.update_stream(full)
            rest = commands(agent.name, 20)
            await send_many(conn, rest)
            wrong = await hold_open(worker, outlasts(settings))
            await conn.js.update_stream(replace(full, max_msgs=-1))
            back = time.monotonic()
            await all_applied_once(conn, agent.name, [e.id for _, e in first + rest])
            resumed = time.monotonic() - back
            assert (
                redeliveries(worker, agent.name) == 0
            )  # held, not handed back: no delivery counted
    finally:
        await conn.close()
    assert_quiet_pause(wrong, resumed, caplog.records)


def assert_quiet_pause(wrong: list[Any], resumed: float, records: list[logging.LogRecord]) -> None:
    """No dead letter, resumed soon after the outage ended, and said so in two ERROR lines
    (one when the switch opened, one when it closed) with no warning between."""
    assert wrong == []
    print(f"resumed {resumed:.1f}s after the outage ended")  # the figure docs/OPERATIONS.md quotes
    assert resumed < 15, f"resumed {resumed:.1f}s after the outage ended"
    assert switch_lines(records) == ["kill switch open", "kill switch closed"]
    lines = outage_lines(records)
    assert lines.get("CRITICAL", 0) == 0 and lines.get("WARNING", 0) == 0 and lines["ERROR"] == 2, (
        lines
    )
