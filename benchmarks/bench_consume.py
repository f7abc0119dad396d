"""Consume throughput: MeshForge's Consumer against a raw nats-py pull loop and FastStream.

Each variant drains its own copy of N pre-published envelopes (128-byte payloads) from a
durable pull consumer, acknowledging each message after a trivial handler.

    python benchmarks/bench_consume.py [--n 20000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import nats
from faststream.nats import JStream, NatsBroker, PullSub
from nats.js import JetStreamContext

sys.path.insert(0, str(Path(__file__).parent))
from _common import BODY_SIZE, console, report, timed

from meshforge.config import load_settings
from meshforge.connection import connect
from meshforge.consumer import Consumer
from meshforge.decisions import Decision, Delivery
from meshforge.envelope import Envelope, Outbound
from meshforge.observability import Metrics
from meshforge.publisher import Publisher
from meshforge.server import EmbeddedServer

BATCH = 100
VARIANTS = ("raw", "mf", "fs")


async def fill(js: JetStreamContext, name: str, n: int) -> None:
    await js.add_stream(name=name.upper(), subjects=[f"bench.{name}"])
    payload = {"blob": "x" * BODY_SIZE}
    items = [Outbound.of(f"bench.{name}", Envelope.new("bench.consume", payload)) for _ in range(n)]
    await Publisher(js).publish_many(items)
    await js.add_consumer(name.upper(), durable_name=f"{name}_durable", ack_policy="explicit", max_ack_pending=1000)


async def main(n: int) -> None:
    async with EmbeddedServer() as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        for name in VARIANTS:
            await fill(js, name, n)

        async def raw() -> None:
            sub = await js.pull_subscribe_bind(durable="raw_durable", stream="RAW")
            done = 0
            while done < n:
                try:
                    msgs = await sub.fetch(BATCH, timeout=1)
                except nats.errors.TimeoutError:
                    continue
                for msg in msgs:
                    await msg.ack()
                done += len(msgs)

        settings = load_settings({"concurrency": BATCH, "batch_size": BATCH, "provision": False})
        conn = await connect(settings, url=server.url)

        async def mf() -> None:
            done = asyncio.Event()
            count = 0

            async def handle(delivery: Delivery) -> Decision | None:
                nonlocal count
                count += 1
                if count >= n:
                    done.set()
                return None

            consumer = Consumer(conn, "MF/mf_durable", handler=handle, settings=settings, metrics=Metrics())
            task = asyncio.create_task(consumer.run())
            await done.wait()
            await consumer.stop()
            await task

        async def fs() -> None:
            broker = NatsBroker(server.url, logger=None)
            done = asyncio.Event()
            count = 0

            @broker.subscriber(
                "bench.fs",
                stream=JStream("FS", declare=False),
                durable="fs_durable",
                pull_sub=PullSub(batch_size=BATCH, timeout=1),
            )
            async def handle(body: dict[str, object]) -> None:
                nonlocal count
                count += 1
                if count >= n:
                    done.set()

            await broker.start()
            await done.wait()
            await broker.stop()

        rows = [
            ("nats-py pull loop", await timed(raw)),
            ("FastStream pull subscriber", await timed(fs)),
            ("MeshForge Consumer", await timed(mf)),
        ]
        for name in VARIANTS:
            info = await js.consumer_info(name.upper(), f"{name}_durable")
            assert info.num_pending == 0, f"{name}: {info.num_pending} left"
        await conn.close()
        await nc.close()
    report("consume and ack", n, rows, baseline="nats-py pull loop")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--quick", action="store_true", help="n = 2,000")
    args = parser.parse_args()
    asyncio.run(main(2_000 if args.quick else args.n))
    console.print("every variant drained its consumer")
