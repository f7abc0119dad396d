"""A consumer process for the SIGTERM test.

Usage: python consumer_worker.py NATS_URL AGENT LOG HANDLER_SECONDS SHUTDOWN_TIMEOUT

Handles ``cmd.default.chaos.<AGENT>.do`` with a handler that sleeps HANDLER_SECONDS,
writing ``start <n> <delivery>`` and ``done <n>`` lines to LOG; the line ``ready`` once
subscribed and ``exit`` after a graceful stop.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from meshforge.config import load_settings
from meshforge.consume.consumer import Consumer, Delivery
from meshforge.ops.observability import Metrics
from meshforge.topology.specs import agent_consumer
from meshforge.transport.connection import connect


async def main(url: str, agent: str, log: TextIO, seconds: float, shutdown: float) -> None:
    settings = load_settings(
        {"ack_wait": 30, "backoff": "30s", "concurrency": 4, "shutdown_timeout": shutdown},
        env={},
    )
    conn = await connect(settings, url=url, name=f"worker-{agent}")

    async def handle(d: Delivery) -> None:
        assert d.envelope is not None
        n = d.envelope.payload["n"]
        log.write(f"start {n} {d.num_delivered}\n")
        await asyncio.sleep(seconds)  # the work
        log.write(f"done {n}\n")

    consumer = Consumer(
        conn, agent_consumer(agent, settings), handler=handle, settings=settings, metrics=Metrics()
    )
    consumer.install_signal_handlers()
    task = asyncio.create_task(consumer.run())
    await consumer.ready.wait()
    log.write("ready\n")
    await task
    await conn.close()
    log.write("exit\n")


if __name__ == "__main__":
    url, agent, log_path, seconds, shutdown = sys.argv[1:6]
    with open(log_path, "a", buffering=1) as out:  # line-buffered: the test reads it live
        asyncio.run(main(url, agent, out, float(seconds), float(shutdown)))
