"""Publish throughput: MeshForge's Publisher against raw nats-py and FastStream.

Every variant publishes the same N envelopes of 128-byte payloads with a Nats-Msg-Id to
a fresh stream and waits for every PubAck.

    python benchmarks/bench_publish.py [--n 20000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import nats
from faststream.nats import NatsBroker

sys.path.insert(0, str(Path(__file__).parent))
from _common import BODY_SIZE, console, report, timed

from meshforge.envelope import Envelope, Outbound
from meshforge.publisher import Publisher
from meshforge.server import EmbeddedServer

IN_FLIGHT = 256


def messages(n: int, prefix: str) -> list[Outbound]:
    payload = {"blob": "x" * BODY_SIZE}
    return [
        Outbound.of(f"bench.{prefix}", Envelope.new("bench.publish", payload, id=f"{prefix}-{i}"))
        for i in range(n)
    ]


async def main(n: int) -> None:
    async with EmbeddedServer() as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        for name in ("raw_seq", "raw_pipe", "mf_seq", "mf_many", "fs_seq"):
            await js.add_stream(name=name.upper(), subjects=[f"bench.{name}"], duplicate_window=120)

        async def raw_seq() -> None:
            for m in messages(n, "raw_seq"):
                await js.publish(m.subject, m.data, headers=m.headers)

        async def raw_pipe() -> None:
            sem = asyncio.Semaphore(IN_FLIGHT)

            async def one(m: Outbound) -> None:
                async with sem:
                    await js.publish(m.subject, m.data, headers=m.headers)

            await asyncio.gather(*(one(m) for m in messages(n, "raw_pipe")))

        publisher = Publisher(js)

        async def mf_seq() -> None:
            for m in messages(n, "mf_seq"):
                await publisher.publish(m.subject, m.data, headers=m.headers, msg_id=m.msg_id)

        async def mf_many() -> None:
            await publisher.publish_many(messages(n, "mf_many"), max_in_flight=IN_FLIGHT)

        broker = NatsBroker(server.url, logger=None)
        await broker.connect()

        async def fs_seq() -> None:
            for m in messages(n, "fs_seq"):
                await broker.publish(m.data, m.subject, headers=m.headers, stream="FS_SEQ")

        rows = [
            ("nats-py sequential", await timed(raw_seq)),
            ("FastStream sequential", await timed(fs_seq)),
            ("MeshForge publish (sequential)", await timed(mf_seq)),
            (f"nats-py pipelined ({IN_FLIGHT} in flight)", await timed(raw_pipe)),
            (f"MeshForge publish_many ({IN_FLIGHT} in flight)", await timed(mf_many)),
        ]
        for name in ("raw_seq", "raw_pipe", "mf_seq", "mf_many", "fs_seq"):
            info = await js.stream_info(name.upper())
            assert info.state.messages == n, f"{name}: stored {info.state.messages} of {n}"
        await broker.stop()
        await nc.close()
    report("publish with PubAck", n, rows, baseline="nats-py sequential")
    console.print("each variant stored exactly n messages")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--quick", action="store_true", help="n = 2,000")
    args = parser.parse_args()
    asyncio.run(main(2_000 if args.quick else args.n))
