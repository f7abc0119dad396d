"""The one sync-over-async bridge (transport/bridge.py) under SyncPublisher and the Spark client:
each closes cleanly, a dead server is one clear line within a bound, no thread is left behind."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from meshforge import SyncPublisher
from meshforge.config import Settings, load_settings
from meshforge.errors import ConnectionFailed
from meshforge.spark.nats_sync import ConnOptions, SyncNats
from meshforge.topology.subjects import STREAM_EVENTS
from meshforge.transport.bridge import BridgeClosed, BridgeTimeout, LoopThread
from meshforge.transport.connection import Connection


@pytest.fixture
def no_thread_left() -> Iterator[Callable[[], None]]:
    """A check that every thread started since the test began has ended (but the worker
    threads of the test's own loop, which ``asyncio.to_thread`` keeps for the next call)."""
    before = set(threading.enumerate())

    def check() -> None:
        started = set(threading.enumerate()) - before
        left = [t.name for t in started if t.is_alive() and not t.name.startswith("asyncio_")]
        assert left == [], f"threads left behind: {left}"

    yield check


@pytest.fixture
def dead_url() -> str:
    """A local port nothing listens on: port 1 (privileged), as a port picked and released
    here could be bound meanwhile by another test's server on port 0."""
    return "nats://127.0.0.1:1"


async def test_sync_publisher_and_spark_client_close_cleanly(
    meshforge_connection: Connection, meshforge_settings: Settings, meshforge_url: str,
    no_thread_left: Callable[[], None],
) -> None:  # fmt: skip
    def both() -> tuple[int, int]:
        with SyncPublisher(meshforge_settings) as publisher:
            seq = publisher.publish("evt.default.test.bridge.x", {"i": 1}).seq
            assert publisher._bridge.thread is not None and publisher._bridge.thread.is_alive()
        with SyncNats(ConnOptions(servers=(meshforge_url,))) as client:
            last = client.stream_info(STREAM_EVENTS).last_seq
        return seq, last

    # called from inside a running event loop, as a notebook or an async caller would
    seq, last = both()
    assert seq == last >= 1
    no_thread_left()
    seq2, last2 = await asyncio.to_thread(both)  # and from a plain thread
    assert seq2 == last2 == seq + 1
    no_thread_left()


def test_a_dead_server_is_one_clear_line_within_a_bound(
    dead_url: str, no_thread_left: Callable[[], None]
) -> None:
    settings = load_settings({"connect_attempts": 2, "connect_timeout": 0.5}, env={})
    publisher = SyncPublisher(settings, nats_url=dead_url, timeout=10)
    start = time.monotonic()
    with pytest.raises(ConnectionFailed) as by_publisher:
        publisher.publish("evt.default.test.bridge.x", {"i": 1})
    took_publisher = time.monotonic() - start
    publisher.close()

    start = time.monotonic()
    with pytest.raises(ConnectionFailed) as by_spark:
        SyncNats(ConnOptions(servers=(dead_url,), connect_attempts=2, connect_timeout=0.5))
    took_spark = time.monotonic() - start

    for error, took in ((by_publisher.value, took_publisher), (by_spark.value, took_spark)):
        text = str(error)
        assert "\n" not in text and text.startswith(
            f"cannot connect to NATS at {dead_url} after 2 attempt(s)"
        )
        # The bound is the feature (not the publisher's 10 s): two attempts of at most 0.5 s
        # and a backoff of at most 0.2 s (1.2 s), over 5x that here.
        assert took < 8.0, f"{took:.1f}s: {text}"
    no_thread_left()


def test_every_wait_is_bounded_and_a_call_that_hangs_is_cancelled(
    no_thread_left: Callable[[], None],
) -> None:
    bridge = LoopThread("meshforge-test")
    ended = threading.Event()

    async def hang() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    start = time.monotonic()
    with pytest.raises(BridgeTimeout, match=r"no result within 0\.2s"):
        bridge.run(hang(), timeout=0.2)
    assert ended.wait(5.0), "the call that hung was not cancelled"

    async def own_timeout() -> None:
        raise TimeoutError("the call's own")

    with pytest.raises(TimeoutError, match="the call's own") as own:
        bridge.run(own_timeout(), timeout=5.0)
    assert not isinstance(own.value, BridgeTimeout)

    bridge.submit(hang())  # still running at close: cancelled, the thread joined anyway
    ended.clear()
    bridge.close(timeout=0.3, last=hang)  # a last step that hangs too is given up on
    assert ended.is_set() and bridge.closed
    # Every wait bounded is the feature (the calls hang for an hour): a 0.2 s run, then a
    # close whose last step, loop stop and join get 0.3 s each (1.1 s), 5x that.
    assert time.monotonic() - start < 5 * (0.2 + 3 * 0.3)
    with pytest.raises(BridgeClosed):
        bridge.run(asyncio.sleep(0), timeout=1.0)
    bridge.close()  # twice is fine
    no_thread_left()


async def test_the_spark_client_turns_a_call_past_its_bound_into_a_clear_error(
    meshforge_connection: Connection, meshforge_url: str, no_thread_left: Callable[[], None]
) -> None:
    def call() -> str:
        with SyncNats(ConnOptions(servers=(meshforge_url,))) as client:
            with pytest.raises(ConnectionFailed) as late:
                client.run(asyncio.sleep(3600), timeout=0.2)
            assert client.stream_info(STREAM_EVENTS).name == STREAM_EVENTS  # still usable
            return str(late.value)

    assert await asyncio.to_thread(call) == f"NATS at {meshforge_url}: no answer within 0.2s"
    no_thread_left()
