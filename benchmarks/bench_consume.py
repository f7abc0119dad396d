"""Consume throughput: MeshForge's Consumer against a raw nats-py pull loop and FastStream.

Each variant drains its own copy of N pre-published envelopes (128-byte payloads) from a
durable pull consumer, acknowledging each message after a trivial handler. The variants
take turns for ``--repeat`` rounds, each on fresh copies; the best round of each counts.

    python benchmarks/bench_consume.py [--n 40000] [--repeat 2] [--quick]
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
from meshforge.consume.consumer import Consumer
from meshforge.consume.decisions import Decision, Delivery
from meshforge.envelope import Envelope, Outbound
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer

BATCH = 100
VARIANTS = ("raw", "fs", "mf")


async def fill(js: JetStreamContext, name: str, n: int) -> None:
    await js.add_stream(name=name.upper(), subjects=[f"bench.{name}"])
    payload = {"blob": "x" * BODY_SIZE}
    items = [Outbound.of(f"bench.{name}", Envelope.new("bench.consume", payload)) for _ in range(n)]
    await Publisher(js).publish_many(items)
    await js.add_consumer(
        name.upper(), durable_name=f"{name}_durable", ack_policy="explicit", max_ack_pending=1000
    )


async def main(n: int, repeat: int) -> None:
    async with EmbeddedServer() as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        settings = load_settings({"concurrency": BATCH, "batch_size": BATCH, "provision": False})
        conn = await connect(settings, url=server.url)

        async def raw(name: str) -> None:
            sub = await js.pull_subscribe_bind(durable=f"{name}_durable", stream=name.upper())
            done = 0
            while done < n:
                try:
                    msgs = await sub.fetch(BATCH, timeout=1)
                except nats.errors.TimeoutError:
                    continue
                for msg in msgs:
                    await msg.ack()
                done += len(msgs)

        async def mf(name: str) -> None:
            done = asyncio.Event()
            count = 0

            async def handle(delivery: Delivery) -> Decision | None:
                nonlocal count
                count += 1
                if count >= n:
                    done.set()
                return None

            consumer = Consumer(
                conn,
                f"{name.upper()}/{name}_durable",
                handler=handle,
                settings=settings,
                metrics=Metrics(),
            )
            task = asyncio.create_task(consumer.run())
            await done.wait()
            await consumer.stop()
            await task

        async def fs(name: str) -> None:
            broker = NatsBroker(server.url, logger=None)
            done = asyncio.Event()
            count = 0

            @broker.subscriber(
                f"bench.{name}",
                stream=JStream(name.upper(), declare=False),
                durable=f"{name}_durable",
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

        variants = {
            "nats-py pull loop": raw,
            "FastStream pull subscriber": fs,
            "MeshForge Consumer": mf,
        }
        best: dict[str, float] = {}
        for round_ in range(repeat):  # each round drains fresh copies; the best round counts
            for index, (label, variant) in enumerate(variants.items()):
                name = f"{VARIANTS[index]}{round_}"
                await fill(js, name, n)
                seconds = await timed(lambda v=variant, nm=name: v(nm))
                best[label] = min(best.get(label, seconds), seconds)
                info = await js.consumer_info(name.upper(), f"{name}_durable")
                assert info.num_pending == 0, f"{name}: {info.num_pending} left"
                await js.delete_stream(name.upper())
        await conn.close()
        await nc.close()
    report("consume and ack", n, list(best.items()), baseline="nats-py pull loop")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=40_000)
    parser.add_argument("--quick", action="store_true", help="n = 2,000")
    parser.add_argument(
        "--repeat", type=int, default=2, help="rounds; the best of each variant counts"
    )
    args = parser.parse_args()
    asyncio.run(main(2_000 if args.quick else args.n, args.repeat))
    console.print("every variant drained its consumer")
