"""A pull consumer keeps working after its server is killed (SIGKILL) and restarted.

Plain nats-py pull subscriptions are known to stall here: the restarted server has
forgotten the waiting pull request and the client keeps waiting on it. MeshForge's pull
requests carry idle heartbeats; silence means the request died, and a new one is sent
(after two, the inbox is rebuilt).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from consumer_chaos import settings

from meshforge.consume.consumer import Consumer, Delivery
from meshforge.envelope import Envelope
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.topology.provision import ensure
from meshforge.topology.specs import agent_consumer, default_streams
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer
from polling import wait_until

pytestmark = pytest.mark.slow

SUBJECT = "cmd.default.chaos.restart.do"


async def publish(publisher: Publisher, start: int, count: int) -> set[int]:
    for n in range(start, start + count):
        await publisher.publish(SUBJECT, Envelope.new("restart.do", {"n": n}))
    return set(range(start, start + count))


@pytest.mark.parametrize("pause", [0.0, 3.0], ids=["immediate", "after-3s"])
async def test_consumer_resumes_after_server_kill_and_restart(
    private_server: EmbeddedServer, pause: float
) -> None:
    s = settings(ack_wait=5, backoff="1s", publish_attempts=20, publish_backoff_cap=0.5)
    conn = await connect(s, url=private_server.url, name="consumer")
    pub_conn = await connect(s, url=private_server.url, name="publisher")
    metrics = Metrics()
    try:
        await ensure(conn.js, default_streams(s))
        spec = agent_consumer("restart", s)
        processed: set[int] = set()

        async def handle(d: Delivery) -> None:
            assert d.envelope is not None
            processed.add(d.envelope.payload["n"])

        consumer = Consumer(conn, spec, handler=handle, settings=s, metrics=metrics)
        task = asyncio.create_task(consumer.run())
        await asyncio.wait_for(consumer.ready.wait(), 10)
        publisher = Publisher(pub_conn.js, s)
        before = await publish(publisher, 0, 5)
        await wait_until(lambda: before <= processed, timeout=10, what="messages before the kill")

        # The consumer sits in a long poll when the server dies.
        await asyncio.to_thread(private_server.kill)
        await asyncio.sleep(pause)  # the server stays down this long
        await asyncio.to_thread(private_server.start)
        restarted = time.monotonic()

        after = await publish(publisher, 100, 5)
        await wait_until(
            lambda: after <= processed, timeout=30, what="messages published after the restart"
        )
        assert time.monotonic() - restarted < 30
        await consumer.stop(timeout=5)
        await asyncio.wait_for(task, 10)
        assert before | after <= processed
    finally:
        await pub_conn.close()
        await conn.close()
