"""The control plane end to end: real server, nodes as subprocesses (``meshforge node``).

"Runs once" is proven by the test node's run log, a file outside the node's store.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from control_support import NodeProcess, dead_letter, reply_count, runs, stored_count
from nats.js.errors import NotFoundError
from typer.testing import CliRunner, Result

from meshforge.cli import app
from meshforge.config import load_settings
from meshforge.control import ControlClient, Reply, node_durable
from meshforge.control.runtime import NodeRuntime
from meshforge.demo import DemoNode
from meshforge.errors import ConfigError
from meshforge.store import open_store
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

REPLY_TIMEOUT = 20.0


@pytest.fixture
async def conn(nats_url: str) -> AsyncIterator[Connection]:
    connection = await connect(load_settings({"nats_url": nats_url}), name="control-test")
    await ensure(connection.js, default_streams(load_settings()), [])
    yield connection
    await connection.close()


@pytest.fixture
def ctl(conn: Connection) -> ControlClient:
    return ControlClient(conn)


@pytest.fixture
def site() -> str:
    """A site of the test's own, so tests sharing the session server never see each other."""
    return f"s{uuid.uuid4().hex[:10]}"


@pytest.fixture
def run_log(tmp_path: Path) -> Path:
    return tmp_path / "runs.log"


NodeFactory = Callable[..., NodeProcess]


@pytest.fixture
def start_node(nats_url: str, tmp_path: Path, run_log: Path, site: str) -> Iterator[NodeFactory]:
    """Start ``meshforge node <site> n1 control_testnode:RecordingNode``; stopped at the end."""
    started: list[NodeProcess] = []
    store_url = f"sqlite:///{tmp_path / 'node.db'}"

    def start(
        node: str = "n1",
        env: dict[str, str] | None = None,
        label: str | None = None,
        store: str | None = None,
    ) -> NodeProcess:
        proc = NodeProcess(
            site, node, nats_url=nats_url, store_url=store or store_url, run_log=run_log,
            log_dir=tmp_path, env=env, label=label or f"{node}-{len(started)}",
        )  # fmt: skip
        started.append(proc.start())
        return proc

    yield start
    for proc in started:
        proc.stop()


async def _reply(ctl: ControlClient, site: str, command_id: str, node: str = "n1") -> Reply:
    reply = await ctl.wait_reply(site, node, command_id, timeout=REPLY_TIMEOUT)
    assert reply is not None, f"no reply to {command_id} within {REPLY_TIMEOUT}s"
    return reply


async def test_command_sent_while_node_is_down_runs_when_it_starts(
    ctl: ControlClient, conn: Connection, site: str, run_log: Path, start_node: NodeFactory
) -> None:
    command_id = await ctl.send(site, "n1", "echo", {"hello": "world"})
    before = await ctl.status(site, "n1")
    assert (before.epoch, before.mailbox_depth, before.consumer_exists) == (None, 1, False)

    node = start_node()
    reply = await _reply(ctl, site, command_id)
    assert (reply.status, reply.result, reply.error, reply.node_epoch) == (
        "ok",
        {"hello": "world"},
        None,
        1,
    )
    assert reply.envelope.causation_id == command_id
    assert [r[0] for r in runs(run_log)] == [command_id]

    after = await ctl.status(site, "n1")
    assert after.epoch == 1 and after.alive and after.consumer_exists

    async def acked() -> bool:  # the reply goes out before the ack: the mailbox empties just after
        return (await ctl.status(site, "n1")).mailbox_depth == 0

    await wait_until(acked, 20, "the command to leave the mailbox")
    assert await reply_count(conn.js, control_reply_subject(site, "n1")) == 1

    node.stop()  # graceful: its last announcement says so
    gone = await ctl.status(site, "n1")
    assert gone.announcement is not None and gone.announcement.state == "stopped"
    assert not gone.alive and gone.epoch == 1


async def test_scheduled_command_runs_at_its_time_not_before(
    ctl: ControlClient, site: str, run_log: Path, start_node: NodeFactory
) -> None:
    # max_deliver=1: waiting for not_before must not count as failed deliveries.
    node = start_node(env={"MESHFORGE_MAX_DELIVER": "1"})
    warm = await ctl.send(site, "n1", "echo", {"warm": True})
    await _reply(ctl, site, warm)

    not_before = datetime.now(UTC) + timedelta(seconds=3)
    command_id = await ctl.send(site, "n1", "echo", {"at": "later"}, not_before=not_before)
    reply = await _reply(ctl, site, command_id)
    assert reply.status == "ok", node.log()
    [(_, _, ran_at)] = [r for r in runs(run_log) if r[0] == command_id]
    lateness = ran_at - not_before.timestamp()
    assert 0 <= lateness <= 1.0, f"ran {lateness:+.3f}s after its not_before"


async def test_long_command_outlives_ack_wait_and_runs_once(
    ctl: ControlClient, conn: Connection, site: str, run_log: Path, start_node: NodeFactory
) -> None:
    # ack_wait 1 s, a 3 s command: only in-progress acks keep it from being redelivered.
    start_node(env={"MESHFORGE_ACK_WAIT": "1"})
    command_id = await ctl.send(site, "n1", "sleep", {"seconds": 3})
    reply = await _reply(ctl, site, command_id)
    assert (reply.status, reply.result) == ("ok", {"slept": 3})
    # A redelivery during the sleep would have found no stored reply and run it again.
    assert [r[0] for r in runs(run_log)] == [command_id]
    assert await reply_count(conn.js, control_reply_subject(site, "n1")) == 1


async def test_expired_command_is_not_run(
    ctl: ControlClient, conn: Connection, site: str, run_log: Path, start_node: NodeFactory
) -> None:
    deadline = datetime.now(UTC) - timedelta(seconds=1)
    command_id = await ctl.send(site, "n1", "echo", {"late": True}, deadline=deadline)
    start_node()
    reply = await _reply(ctl, site, command_id)
    assert reply.status == "expired" and reply.result is None
    assert reply.error and "deadline" in reply.error
    letter = await dead_letter(conn.js, control_command_subject(site, "n1"))
    assert letter.headers is not None and letter.headers["Dlq-Reason"] == "expired"
    assert json.loads(letter.data or b"")["id"] == command_id
    assert runs(run_log) == []


async def test_epoch_mismatch_is_rejected_and_restart_bumps_the_epoch(
    ctl: ControlClient, conn: Connection, site: str, run_log: Path, start_node: NodeFactory
) -> None:
    start_node()
    wrong = await ctl.send(site, "n1", "echo", {}, expect_epoch=7)
    reply = await _reply(ctl, site, wrong)
    assert (reply.status, reply.node_epoch) == ("rejected", 1)
    letter = await dead_letter(conn.js, control_command_subject(site, "n1"))
    assert letter.headers is not None and letter.headers["Dlq-Reason"] == "rejected"
    assert runs(run_log) == []

    right = await ctl.send(site, "n1", "echo", {"n": 1}, expect_epoch=1)
    assert (await _reply(ctl, site, right)).status == "ok"

    restart = await ctl.send(site, "n1", "restart", {})
    reply = await _reply(ctl, site, restart)
    assert (reply.status, reply.node_epoch, reply.result["previous_epoch"]) == ("ok", 2, 1)
    stale = await ctl.send(site, "n1", "echo", {}, expect_epoch=1)
    assert (await _reply(ctl, site, stale)).status == "rejected"
    fresh = await ctl.send(site, "n1", "echo", {}, expect_epoch=2)
    assert (await _reply(ctl, site, fresh)).node_epoch == 2
    assert [r[0] for r in runs(run_log)] == [right, fresh]
    assert (await ctl.status(site, "n1")).epoch == 2


@pytest.mark.parametrize("crash_at", ["after_commit", "after_publish"])
async def test_node_killed_before_its_ack_does_not_run_the_command_twice(
    ctl: ControlClient,
    conn: Connection,
    site: str,
    run_log: Path,
    start_node: NodeFactory,
    crash_at: str,
) -> None:
    crashing = start_node(env={"MESHFORGE_CRASH_AT": crash_at, "MESHFORGE_ACK_WAIT": "2"})
    command_id = await ctl.send(site, "n1", "echo", {"once": True})
    assert await crashing.wait_exit(REPLY_TIMEOUT) == -9, crashing.log()
    assert [r[0] for r in runs(run_log)] == [command_id]

    start_node(env={"MESHFORGE_ACK_WAIT": "2"})
    reply = await _reply(ctl, site, command_id)
    assert (reply.status, reply.result, reply.node_epoch) == ("ok", {"once": True}, 1)
    # The mailbox empties (the redelivery was acked) and the command ran exactly once.
    end = time.monotonic() + REPLY_TIMEOUT
    while (await ctl.status(site, "n1")).mailbox_depth and time.monotonic() < end:
        await _pause()
    assert (await ctl.status(site, "n1")).mailbox_depth == 0
    assert [r[0] for r in runs(run_log)] == [command_id]
    assert await reply_count(conn.js, control_reply_subject(site, "n1")) == 1


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_two_instances_of_a_node_run_each_command_once(
    ctl: ControlClient,
    conn: Connection,
    site: str,
    run_log: Path,
    start_node: NodeFactory,
    backend: str,
    request: pytest.FixtureRequest,
) -> None:
    # The instances share one store: SQLite on one machine, PostgreSQL across machines.
    store = request.getfixturevalue("pg_database") if backend == "postgres" else None
    a = start_node(label="a", store=store)
    await _until_pulling(conn, site, 1, a)
    b = start_node(label="b", store=store)
    await _until_pulling(conn, site, 2, a, b)
    # Two boots on one store: epoch 2. Both instances announce the store's epoch, so the
    # one that booted first does not keep telling the world its own (older) count.
    seen = await _epochs_seen(ctl, site, seconds=2.5)
    assert seen[-1] == 2 and set(seen[seen.index(2) :]) == {2}, seen

    ids = list(await asyncio.gather(*(ctl.send(site, "n1", "echo", {"i": i}) for i in range(40))))
    replies = [await _reply(ctl, site, command_id) for command_id in ids]
    assert [r.result for r in replies] == [{"i": i} for i in range(40)]
    assert all(r.status == "ok" for r in replies)
    ran = [r[0] for r in runs(run_log)]
    assert sorted(ran) == sorted(ids), "every command ran exactly once"
    assert "-> ok" in a.log() and "-> ok" in b.log(), "both instances took a share of the work"
    assert await reply_count(conn.js, control_reply_subject(site, "n1")) == 40
    assert await stored_count(conn.js, STREAM_CONTROL, control_command_subject(site, "n1")) == 0


async def _epochs_seen(ctl: ControlClient, site: str, *, seconds: float) -> list[int | None]:
    """The announced epochs over a window longer than two presence intervals (1 s)."""
    seen: list[int | None] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen.append((await ctl.status(site, "n1")).epoch)
        await _pause()
    return seen


async def _until_pulling(conn: Connection, site: str, count: int, *nodes: NodeProcess) -> None:
    """Wait until ``count`` pull requests wait on the node's durable consumer."""
    end = time.monotonic() + REPLY_TIMEOUT
    while True:
        try:
            info = await conn.js.consumer_info(STREAM_CONTROL, node_durable(site, "n1"))
            if (info.num_waiting or 0) >= count:
                return
        except NotFoundError:
            pass
        logs = "\n".join(node.log() for node in nodes)
        assert time.monotonic() < end, f"not {count} instance(s) pulling:\n{logs}"
        await _pause()


async def test_malformed_control_message_is_dead_lettered(
    ctl: ControlClient, conn: Connection, site: str, run_log: Path, start_node: NodeFactory
) -> None:
    start_node()
    subject = control_command_subject(site, "n1")
    await conn.js.publish(subject, b"{not json", headers={"Nats-Msg-Id": f"bad-{site}"})
    letter = await dead_letter(conn.js, subject)
    assert letter.headers is not None and letter.headers["Dlq-Reason"] == "malformed"
    assert letter.data == b"{not json"
    command_id = await ctl.send(site, "n1", "echo", {"still": "alive"})
    assert (await _reply(ctl, site, command_id)).status == "ok"
    assert [r[0] for r in runs(run_log)] == [command_id]


async def test_repeated_id_gets_the_stored_reply_and_failing_command_gives_up(
    ctl: ControlClient, conn: Connection, site: str, run_log: Path, start_node: NodeFactory
) -> None:
    start_node(env={"MESHFORGE_MAX_DELIVER": "2", "MESHFORGE_BACKOFF": "100ms"})
    first = await ctl.send(site, "n1", "echo", {"v": 1}, command_id=f"{site}-fixed")
    assert (await _reply(ctl, site, first)).result == {"v": 1}
    # The same id again, past the server's duplicate window: a new message, not run again.
    await conn.js.publish(
        control_command_subject(site, "n1"),
        json.dumps({"id": first, "type": "echo", "payload": {"v": 2}}).encode(),
        headers={"Nats-Msg-Id": f"{first}-again"},
    )
    end = time.monotonic() + REPLY_TIMEOUT
    while await stored_count(conn.js, STREAM_CONTROL, control_command_subject(site, "n1")):
        assert time.monotonic() < end, "the repeated command was never acked"
        await _pause()
    assert [r[0] for r in runs(run_log)] == [first]

    failing = await ctl.send(site, "n1", "fail", {})
    reply = await _reply(ctl, site, failing)
    assert reply.status == "error" and reply.error and "always fails" in reply.error
    letter = await dead_letter(conn.js, control_command_subject(site, "n1"))
    assert letter.headers is not None and letter.headers["Dlq-Reason"] == "max_deliveries"
    assert [r[1] for r in runs(run_log)].count("fail") == 2


def test_ctl_commands_send_wait_reply_and_status(
    nats_url: str, site: str, start_node: NodeFactory
) -> None:
    start_node()
    url = ["--nats-url", nats_url]
    sent = _cli("ctl", "send", site, "n1", "echo", '{"ping": 1}', "--wait", "20", *url)
    assert sent.exit_code == 0, sent.output
    reply = json.loads(sent.stdout)
    assert (reply["status"], reply["result"], reply["node_epoch"]) == ("ok", {"ping": 1}, 1)

    answered = _cli("ctl", "reply", site, "n1", reply["command_id"], *url)
    assert answered.exit_code == 0 and json.loads(answered.stdout) == reply
    unknown = _cli("ctl", "reply", site, "n1", "no-such-command", *url)
    assert unknown.exit_code == 1 and "no reply" in unknown.stderr
    unanswered = _cli("ctl", "send", site, "nobody", "echo", "--wait", "0.5", *url)
    assert unanswered.exit_code == 1 and "ctl reply" in unanswered.stderr

    rejected = _cli("ctl", "send", site, "n1", "echo", "--expect-epoch", "9", "--wait", "20", *url)
    assert rejected.exit_code == 1 and json.loads(rejected.stdout)["status"] == "rejected"

    later = ["--not-before", "1h"]
    queued = _cli("ctl", "send", site, "n1", "sleep", '{"seconds": 0}', *later, *url)
    assert queued.exit_code == 0 and "queued sleep as" in queued.stdout

    status = _cli("ctl", "status", site, "n1", "--json", *url)
    assert status.exit_code == 0, status.output
    report = json.loads(status.stdout)
    assert (report["epoch"], report["alive"], report["mailbox_depth"]) == (1, True, 1)

    bad = _cli("ctl", "send", site, "n1", "echo", "[1]", *url)
    assert bad.exit_code != 0 and "JSON object" in bad.output
    bad_time = _cli("ctl", "send", site, "n1", "echo", "--deadline", "tomorrow", *url)
    assert isinstance(bad_time.exception, ConfigError) and "--deadline" in str(bad_time.exception)


def _cli(*args: str) -> Result:
    # In-process: the node is the real subprocess; the operator's commands need no second one.
    return CliRunner().invoke(app, list(args))


async def _pause() -> None:
    await asyncio.sleep(0.05)  # polling interval while waiting for the server's state


async def test_stored_replies_past_their_retention_are_deleted(
    ctl: ControlClient, conn: Connection, site: str, tmp_path: Path
) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'node.db'}")
    settings = load_settings({"reply_retention": "0s"})
    runtime = NodeRuntime(
        DemoNode(), site, "n1", conn, store, settings=settings, cleanup_interval=0.05
    )
    run = asyncio.create_task(runtime.run())
    try:
        command_id = await ctl.send(site, "n1", "echo", {"n": 1})
        assert (await _reply(ctl, site, command_id)).status == "ok"

        def stored() -> bool:
            return store.run(lambda tx: tx.node_reply_get(site, "n1", command_id)) is not None

        await wait_until(lambda: not stored(), timeout=10, what="the stored reply deleted")
        # the reply itself stays readable on the stream
        assert (await _reply(ctl, site, command_id)).status == "ok"
    finally:
        await runtime.stop()
        await run
        store.close()
