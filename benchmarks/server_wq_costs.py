"""What nats-server spends on a stream with many filtered consumers: work-queue against limits
retention (not part of ``make bench``; the measurement behind CONTROL_PLANE.md "Limits").

For each retention, on a fresh embedded server: one stream, ``N`` durable consumers each
filtered to a subject of its own (as node mailboxes are), then 1,000 messages published
round-robin and each fetched and acknowledged by its consumer. Prints the server's CPU
seconds (from /proc) for the creates and for the fetches and acks, and the wall time of
the last tenth of the creates.

    python benchmarks/server_wq_costs.py [N]
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import nats
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig

from meshforge.transport.server import EmbeddedServer

MESSAGES = 1000


def cpu_seconds(pid: int | None) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(server: EmbeddedServer, retention: RetentionPolicy, n: int) -> str:
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    name = f"S{retention.value}"
    await js.add_stream(
        StreamConfig(
            name=name, subjects=[f"{name}.>"], retention=retention, max_consumers=2**31 - 1
        )
    )
    cpu = cpu_seconds(server.pid)
    tenth = time.perf_counter()
    for i in range(n):
        if i == n - n // 10:
            tenth = time.perf_counter()
        config = ConsumerConfig(
            durable_name=f"c{i}", filter_subject=f"{name}.{i}", ack_policy=AckPolicy.EXPLICIT
        )
        await js.add_consumer(name, config)
    last_tenth = time.perf_counter() - tenth
    creates = cpu_seconds(server.pid) - cpu
    for i in range(MESSAGES):
        await js.publish(f"{name}.{i % n}", b"x")
    cpu = cpu_seconds(server.pid)
    for i in range(MESSAGES):
        k = i % n
        sub = await js.pull_subscribe(f"{name}.{k}", durable=f"c{k}", stream=name)
        for msg in await sub.fetch(1, timeout=5):
            await msg.ack_sync()
        await sub.unsubscribe()
    acks = cpu_seconds(server.pid) - cpu
    await nc.close()
    return (
        f"{retention.value:>9}, {n:,} consumers: server CPU {creates:.2f} s for the creates "
        f"(last tenth {last_tenth:.2f} s wall), {acks:.2f} s for {MESSAGES:,} fetches and acks"
    )


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    for retention in (RetentionPolicy.WORK_QUEUE, RetentionPolicy.LIMITS):
        with (
            tempfile.TemporaryDirectory() as home,
            EmbeddedServer(store_dir=Path(home) / "nats") as server,
        ):
            print(asyncio.run(measure(server, retention, n)), flush=True)


if __name__ == "__main__":
    main()
