"""Jobs against a real server: rollout at a rate, retries, abort, cancel, expiry, and a
controller SIGKILLed mid-rollout; and CONTROL_PLANE.md's promises: a cancel lets a command
already running finish, a late reply to an older attempt is ignored, and a node that took a
TTL'd command in time still runs it and answers. Nodes run in-process; "ran once" is the
run log's word."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from control_support import reply_count, runs, stored_count
from fleet_support import Fleet, child, meshforge, simulated_site

from meshforge.config import load_settings
from meshforge.control.jobs import JobSpec, JobStore, attempt_id
from meshforge.control.reply import reply_envelope
from meshforge.control.rollout import JobController, summarize
from meshforge.envelope import Envelope
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import (
    STREAM_CONTROL,
    control_command_subject,
    control_reply_subject,
)
from meshforge.transport.connection import Connection, connect
from polling import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def conn(nats_url: str) -> AsyncIterator[Connection]:
    connection = await connect(load_settings({"nats_url": nats_url}), name="jobs-test")
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


async def test_rollout_at_a_rate_reaches_every_node_once(
    conn: Connection, fleet: Fleet, site: str, run_log: Path, nats_url: str
) -> None:
    names = [f"n{i}" for i in range(4)]
    for name in names:
        await fleet.start(site, name)
    store = await JobStore.open(conn.js)
    job = _job()
    await store.create(JobSpec(job, "echo", {"v": 1}, targets=[(site, n) for n in names], rate=120))
    metrics = Metrics()
    assert (
        await asyncio.wait_for(JobController(conn, store, job, metrics=metrics).run(), 30)
        == "completed"
    )
    exported = metrics.render().decode()
    assert f'meshforge_job_nodes{{job_name="{job}",state="SUCCEEDED"}} 4.0' in exported
    assert f'meshforge_job_oldest_in_progress_seconds{{job_name="{job}"}} 0.0' in exported

    ran = runs(run_log)
    assert sorted(r[0] for r in ran) == sorted(attempt_id(job, site, n, 1) for n in names)
    times = sorted(r[2] for r in ran)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.4, f"120/min means 0.5 s apart, got gaps {gaps}"

    result = await meshforge("ctl", "job", "status", job, "--json", "--nats-url", nats_url)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["status"] == "completed" and report["counts"]["SUCCEEDED"] == 4
    assert {n["state"] for n in report["nodes"]} == {"SUCCEEDED"}
    listed = await meshforge("ctl", "job", "ls", "--json", "--nats-url", nats_url)
    assert job in [row["job"] for row in json.loads(listed.stdout)]


async def test_failed_nodes_are_retried_with_new_ids_then_the_job_aborts(
    conn: Connection, fleet: Fleet, site: str, run_log: Path
) -> None:
    names = [f"n{i}" for i in range(5)]
    for name in names[:2]:
        await fleet.start(site, name)
    store = await JobStore.open(conn.js)
    job = _job()
    # One at a time, so the abort is judged after the first two nodes; the rest never get it.
    spec = JobSpec(job, "fail", {}, targets=[(site, n) for n in names], retries=1,
                   abort_after=50, min_done=2, rate=600)  # fmt: skip
    await store.create(spec)
    metrics = Metrics()
    assert (
        await asyncio.wait_for(JobController(conn, store, job, metrics=metrics).run(), 30)
        == "aborted"
    )
    assert f'meshforge_job_failed_share{{job_name="{job}"}} 1.0' in metrics.render().decode()

    records = await store.nodes(job)
    assert summarize(records)["FAILED"] == 2 and summarize(records)["CANCELED"] == 3
    ran = Counter(r[0] for r in runs(run_log))
    expected = {attempt_id(job, site, n, a) for n in names[:2] for a in (1, 2)}
    assert set(ran) == expected and set(ran.values()) == {1}
    assert (await store.status(job))["status"] == "aborted"
    assert all(records[f"{site}.{n}"].attempt == 0 for n in names[2:])


async def test_canceled_job_runs_nothing_more(
    conn: Connection, fleet: Fleet, site: str, run_log: Path, nats_url: str
) -> None:
    names = [f"n{i}" for i in range(4)]
    store = await JobStore.open(conn.js)
    job = _job()
    # 1/min: the first command is sent at once (its node is down), the others wait their turn
    # (at 60/min a cancel slower than a second, as a loaded machine makes it, let n1 go too).
    await store.create(JobSpec(job, "echo", {}, targets=[(site, n) for n in names], rate=1))
    controller = asyncio.create_task(JobController(conn, store, job).run())

    async def first_sent() -> bool:
        return (await store.nodes(job))[f"{site}.n0"].state == "IN_PROGRESS"

    await wait_until(first_sent, 10, "the first command to be sent")
    result = await meshforge("ctl", "job", "cancel", job, "--nats-url", nats_url)
    assert result.returncode == 0, result.stderr
    await fleet.start(site, "n0")  # its command waited in the mailbox: it must not run
    assert await asyncio.wait_for(controller, 30) == "canceled"

    records = await store.nodes(job)
    assert {r.state for r in records.values()} == {"CANCELED"}
    assert records[f"{site}.n0"].by_reply, "n0 itself answered CANCELED"
    assert runs(run_log) == []


async def test_deadline_expires_the_letter_on_the_server(conn: Connection, site: str) -> None:
    store = await JobStore.open(conn.js)
    job = _job()
    deadline = (datetime.now(UTC) + timedelta(seconds=2)).isoformat()
    await store.create(JobSpec(job, "echo", {}, targets=[(site, "down")], deadline=deadline))
    subject = control_command_subject(site, "down")
    controller = asyncio.create_task(JobController(conn, store, job).run())

    async def stored() -> bool:
        return await stored_count(conn.js, STREAM_CONTROL, subject) == 1

    await wait_until(stored, 10, "the command to wait in the mailbox")

    # The node never comes back: the server itself removes the letter at its TTL.
    async def removed() -> bool:
        return await stored_count(conn.js, STREAM_CONTROL, subject) == 0

    await wait_until(removed, 15, "the server to expire the letter")
    assert await asyncio.wait_for(controller, 15) == "completed"
    assert (await store.nodes(job))[f"{site}.down"].state == "EXPIRED"


@pytest.mark.parametrize("kill_at", ["mid_rollout", "job_after_send"])
async def test_controller_killed_mid_rollout_loses_and_doubles_nothing(
    conn: Connection, fleet: Fleet, site: str, run_log: Path, nats_url: str, kill_at: str
) -> None:
    names = [f"n{i}" for i in range(6)]
    for name in names:
        await fleet.start(site, name)
    store = await JobStore.open(conn.js)
    job = _job()
    await store.create(JobSpec(job, "echo", {}, targets=[(site, n) for n in names], rate=120))
    args = ("ctl", "job", "run", job, "--nats-url", nats_url)
    env = {"MESHFORGE_CRASH_AT": "job_after_send:3"} if kill_at == "job_after_send" else {}
    async with child(*args, env=env) as first:
        if kill_at == "mid_rollout":

            async def some_done() -> bool:
                return summarize(await store.nodes(job))["SUCCEEDED"] >= 2

            await wait_until(some_done, 20, "two nodes to succeed")
            first.send_signal(signal.SIGKILL)
        assert await asyncio.wait_for(first.wait(), 20) == -signal.SIGKILL
    assert summarize(await store.nodes(job))["SUCCEEDED"] < len(names)
    async with child(*args) as second:
        code = await asyncio.wait_for(second.wait(), 40)
        output = (await second.stdout.read()).decode() if second.stdout else ""
    assert code == 0, output
    assert summarize(await store.nodes(job))["SUCCEEDED"] == len(names)
    ran = Counter(r[0] for r in runs(run_log))
    assert set(ran) == {attempt_id(job, site, n, 1) for n in names}
    assert set(ran.values()) == {1}, f"a command ran twice: {ran}"


async def test_two_controllers_on_one_job_take_turns(
    conn: Connection, fleet: Fleet, site: str, run_log: Path
) -> None:
    names = [f"n{i}" for i in range(3)]
    for name in names:
        await fleet.start(site, name)
    store = await JobStore.open(conn.js)
    job = _job()
    await store.create(JobSpec(job, "echo", {}, targets=[(site, n) for n in names], rate=240))
    first = JobController(conn, store, job, lease_ttl=2.0)
    second = JobController(conn, store, job, lease_ttl=2.0)
    results = await asyncio.wait_for(asyncio.gather(first.run(), second.run()), 30)
    assert results == ["completed", "completed"]
    assert sorted([first.sent, second.sent]) == [0, 3], "one controller sent everything"
    ran = Counter(r[0] for r in runs(run_log))
    assert set(ran) == {attempt_id(job, site, n, 1) for n in names} and set(ran.values()) == {1}


async def test_unanswered_attempts_time_out_are_retried_and_leave_the_mailbox(
    conn: Connection, fleet: Fleet, site: str, run_log: Path
) -> None:
    store = await JobStore.open(conn.js)
    job = _job()
    await store.create(JobSpec(job, "echo", {}, targets=[(site, "late")], timeout=1.0, retries=1))
    assert await asyncio.wait_for(JobController(conn, store, job).run(), 20) == "completed"
    record = (await store.nodes(job))[f"{site}.late"]
    assert (record.state, record.attempt) == ("TIMED_OUT", 2)
    subject = control_command_subject(site, "late")

    async def gone() -> bool:  # each attempt's letter carried the timeout as its TTL
        return await stored_count(conn.js, STREAM_CONTROL, subject) == 0

    await wait_until(gone, 10, "the timed-out letters to expire")
    await fleet.start(site, "late")
    assert runs(run_log) == []


async def test_job_cli_exit_codes_and_nodes_file(
    fleet: Fleet, site: str, nats_url: str, tmp_path: Path
) -> None:
    await fleet.start(site, "a")
    await fleet.start(site, "b")
    listing = tmp_path / "nodes.txt"
    listing.write_text(f"# the valves\n{site}/a\n{site}.b\n")
    base = ("--nats-url", nats_url)
    ok = await meshforge(
        "ctl", "job", "create", _job(), "--command", "echo", "--nodes-file", str(listing), *base
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "SUCCEEDED=2" in ok.stdout
    failed = await meshforge(
        "ctl", "job", "create", _job(), "--command", "nope", "--node", f"{site}/a", *base
    )
    assert failed.returncode == 1 and "FAILED=1" in failed.stdout
    usage = await meshforge(
        "ctl",
        "job",
        "create",
        _job(),
        "--command",
        "echo",
        "--payload",
        "[1]",
        "--node",
        f"{site}/a",
        *base,
    )
    assert usage.returncode == 2 and "expected a JSON object" in usage.stderr
    missing = await meshforge("ctl", "job", "status", "no-such-job", *base)
    assert missing.returncode == 1 and missing.stderr.startswith("error: no job no-such-job")


# CONTROL_PLANE.md's promises on jobs
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


async def test_a_rollout_to_hundreds_of_nodes_keeps_the_asked_rate(
    conn: Connection, site: str
) -> None:
    """300 nodes at 100 commands/s (a fifth of the 500/s the controller is built for): the
    sends come within 10% of the asked rate, and no faster than it allows."""
    names = [f"n{i}" for i in range(300)]
    store = await JobStore.open(conn.js)
    job = _job()
    await store.create(JobSpec(job, "echo", {}, targets=[(site, n) for n in names], rate=6000))
    async with simulated_site(conn, site) as answered:
        assert await asyncio.wait_for(JobController(conn, store, job).run(), 60) == "completed"
    records = await store.nodes(job)
    assert summarize(records)["SUCCEEDED"] == len(names)
    assert set(answered.values()) == {1} and len(answered) == len(names)
    sent = sorted(datetime.fromisoformat(str(r.sent_at)) for r in records.values())
    rate = (len(sent) - 1) / (sent[-1] - sent[0]).total_seconds()
    assert 90 <= rate <= 500, f"asked 100 commands/s, sent {rate:.1f}/s"
