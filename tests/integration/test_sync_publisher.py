"""SyncPublisher: many threads through one publisher, each message stored once; close, exit, fork."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from meshforge import Envelope, SyncPublisher
from meshforge.config import Settings
from meshforge.errors import PublishError
from meshforge.topology.subjects import STREAM_EVENTS
from meshforge.transport.connection import Connection

SRC = Path(__file__).resolve().parents[2] / "src"
THREADS, EACH = 16, 40


async def count(conn: Connection, subject: str) -> int:
    info = await conn.js.stream_info(STREAM_EVENTS, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def test_many_threads_publish_at_once_and_each_message_is_stored_once(
    meshforge_connection: Connection, meshforge_settings: Settings
) -> None:
    publisher = SyncPublisher(meshforge_settings, max_pending=8)
    start = threading.Barrier(THREADS)
    results: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def work(t: int) -> None:
        start.wait()
        try:
            for i in range(EACH):
                r = publisher.publish(f"evt.default.test.load.t{t}", {"i": i}, msg_id=f"m-{t}-{i}")
                assert not r.duplicate
                results.append((t, r.seq))
        except BaseException as exc:  # reported below, with the thread's failure
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert errors == []
        assert len(results) == THREADS * EACH
        assert len({seq for _, seq in results}) == THREADS * EACH
        assert await count(meshforge_connection, "evt.default.test.load.>") == THREADS * EACH
        # The same msg id again is a duplicate the server drops.
        again = publisher.publish("evt.default.test.load.t0", {"i": 0}, msg_id="m-0-0")
        assert again.duplicate
        assert await count(meshforge_connection, "evt.default.test.load.>") == THREADS * EACH
    finally:
        publisher.close()
    assert publisher.closed
    with pytest.raises(PublishError, match="closed"):
        publisher.publish("evt.default.test.load.t0", {"i": 1})
    publisher.close()  # twice is fine


async def test_envelopes_bytes_and_bad_input(
    meshforge_connection: Connection, meshforge_settings: Settings
) -> None:
    with SyncPublisher(meshforge_settings) as publisher:
        env = Envelope.new("order.created", {"order_id": "o-1"})
        assert publisher.publish("evt.default.test.order.created", env).msg_id == env.id
        assert publisher.publish("evt.default.test.raw.x", b'{"raw": true}', msg_id="raw-1").seq > 0
        with pytest.raises(PublishError) as bad:
            publisher.publish("evt.default.test.bad subject", b"{}")
        assert bad.value.kind == "invalid_subject"
        with pytest.raises(PublishError) as nowhere:
            publisher.publish("nowhere.at.all", b"{}")
        assert nowhere.value.kind == "no_stream"
    assert await count(meshforge_connection, "evt.default.test.>") == 2


def _script(body: str, url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_")}
    env["PYTHONPATH"] = str(SRC)
    env["MESHFORGE_NATS_URL"] = url
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


async def test_a_forked_child_publishes_on_its_own_loop_and_exit_closes_it(
    meshforge_connection: Connection, meshforge_url: str
) -> None:
    done = _script(
        """
        import atexit, os
        closed = []
        atexit.register(lambda: print("closed at exit:", closed[0].closed))  # runs after ours
        from meshforge import SyncPublisher
        p = SyncPublisher()
        closed.append(p)
        p.publish("evt.default.test.fork.parent", {"who": "parent"})
        pid = os.fork()
        if pid == 0:
            try:
                r = p.publish("evt.default.test.fork.child", {"who": "child"})
                p.close()
                os._exit(0 if r.seq > 0 else 1)
            except BaseException as exc:
                print("child failed:", exc)
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        print("child exit:", os.waitstatus_to_exitcode(status))
        p.publish("evt.default.test.fork.parent", {"who": "parent again"})
        """,
        meshforge_url,
    )
    assert done.returncode == 0, done.stderr
    assert "child exit: 0" in done.stdout and "closed at exit: True" in done.stdout
    assert await count(meshforge_connection, "evt.default.test.fork.child") == 1
    assert await count(meshforge_connection, "evt.default.test.fork.parent") == 2


def test_a_full_publisher_refuses_after_the_callers_timeout(meshforge_settings: Settings) -> None:
    publisher = SyncPublisher(meshforge_settings, max_pending=2)
    try:
        for _ in range(2):  # two messages in flight, as far as the bound can tell
            assert publisher._slots.acquire(timeout=1)
        with pytest.raises(PublishError) as full:
            publisher.publish("evt.default.test.full.x", {"i": 1}, timeout=0.05)
        assert full.value.kind == "backpressure" and full.value.retriable
    finally:
        publisher.close()
