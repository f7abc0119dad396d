"""CONTROL_PLANE.md's promises on jobs, each against a real server: a cancel lets a command
already running finish, a late reply to an older attempt is ignored, and a node that took
a TTL'd command in time still runs it and answers."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from control_support import reply_count, runs
from fleet_support import Fleet

from meshforge.config import load_settings
from meshforge.control.jobs import JobSpec, JobStore, attempt_id
from meshforge.control.reply import reply_envelope
from meshforge.control.rollout import JobController
from meshforge.envelope import Envelope
from meshforge.publish.publisher import Publisher
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import control_reply_subject
from meshforge.transport.connection import Connection, connect
from polling import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def conn(nats_url: str) -> AsyncIterator[Connection]:
    connection = await connect(load_settings({"nats_url": nats_url}), name="promises-test")
    await ensure(connection.js, default_streams(load_settings()), [])
    yield connection
    await connection.close()


@pytest.fixture
def site() -> str:
    return f"s{uuid.uuid4().hex[:10]}"


@pytest.fixture
def run_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "runs.log"
    monkeypatch.setenv("MESHFORGE_TEST_RUN_LOG", str(path))
    return path


@pytest.fixture
async def fleet(nats_url: str, tmp_path: Path, run_log: Path) -> AsyncIterator[Fleet]:
    async with Fleet(nats_url, tmp_path, max_deliver=1) as nodes:
        yield nodes


def _job() -> str:
    return f"j{uuid.uuid4().hex[:8]}"


async def test_a_command_a_node_is_running_when_its_job_is_canceled_finishes(
    conn: Connection, fleet: Fleet, site: str, run_log: Path
) -> None:
    await fleet.start(site, "n0")
    store = await JobStore.open(conn.js)
    job = _job()
    await store.create(JobSpec(job, "sleep", {"seconds": 3}, targets=[(site, "n0")]))
    controller = asyncio.create_task(JobController(conn, store, job).run())
    await wait_until(lambda: bool(runs(run_log)), 20, "the node to start the command")
    await store.cancel(job)
    # canceled while the command ran: no reply yet
    assert (await store.nodes(job))[f"{site}.n0"].state == "IN_PROGRESS"
    assert await asyncio.wait_for(controller, 30) == "canceled"
    record = (await store.nodes(job))[f"{site}.n0"]
    assert (record.state, record.by_reply, record.error) == ("SUCCEEDED", True, None)
    assert [r[0] for r in runs(run_log)] == [attempt_id(job, site, "n0", 1)]


async def test_a_late_reply_to_an_older_attempt_is_ignored(conn: Connection, site: str) -> None:
    store = await JobStore.open(conn.js)
    job = _job()
    # Nobody answers: attempt 1 times out and attempt 2 is sent, which times out too.
    await store.create(JobSpec(job, "echo", {}, targets=[(site, "late")], timeout=2.0, retries=1))
    controller = asyncio.create_task(JobController(conn, store, job).run())

    async def second_sent() -> bool:
        record = (await store.nodes(job))[f"{site}.late"]
        return (record.state, record.attempt) == ("IN_PROGRESS", 2)

    await wait_until(second_sent, 20, "the second attempt to be sent")
    first = Envelope.new("echo", {}).with_(id=attempt_id(job, site, "late", 1))
    late = reply_envelope(
        first, site=site, node="late", status="ok", result={"late": True}, error=None,
        node_epoch=1,
    )  # fmt: skip
    await Publisher(conn.js).publish(control_reply_subject(site, "late"), late)
    assert await asyncio.wait_for(controller, 30) == "completed"
    record = (await store.nodes(job))[f"{site}.late"]
    assert (record.state, record.attempt, record.result) == ("TIMED_OUT", 2, None)


async def test_a_node_that_took_a_ttld_command_in_time_still_runs_it_and_answers(
    conn: Connection, fleet: Fleet, site: str, run_log: Path
) -> None:
    await fleet.start(site, "n0")
    store = await JobStore.open(conn.js)
    job = _job()
    deadline = (datetime.now(UTC) + timedelta(seconds=2)).isoformat()
    # The node takes the letter at once and answers after the deadline.
    await store.create(
        JobSpec(job, "sleep", {"seconds": 4}, targets=[(site, "n0")], deadline=deadline)
    )
    controller = asyncio.create_task(JobController(conn, store, job).run())
    await wait_until(lambda: bool(runs(run_log)), 20, "the node to take the command")
    assert await asyncio.wait_for(controller, 30) == "completed"
    assert (await store.nodes(job))[f"{site}.n0"].state == "EXPIRED"  # the job ended first

    async def answered() -> bool:
        return await reply_count(conn.js, control_reply_subject(site, "n0")) == 1

    await wait_until(answered, 20, "the node's answer after the deadline")
    assert [r[0] for r in runs(run_log)] == [attempt_id(job, site, "n0", 1)]
