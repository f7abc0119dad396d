"""One process of simulated nodes for ``bench_fleet.py``: real ``NodeRuntime``s, many on one
connection and one SQLite store, each announcing itself every 10 s as a deployed node does.

    python _fleet_nodes.py URL SITE FIRST COUNT OUT_DIR [--concurrency 16]

Starts nodes ``n<FIRST>`` to ``n<FIRST+COUNT-1>`` of ``SITE``, at most ``concurrency`` at
a time, and appends to ``OUT_DIR/ready-<FIRST>.txt`` one ``<node> <unix time>`` line as
each one pulls its mailbox. Every run of the ``echo`` command appends ``<command id>
<unix time>`` to ``OUT_DIR/runs-<FIRST>.txt``: the nodes' own count of what ran, which
the benchmark checks against the controller's. Runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from meshforge.config import load_settings
from meshforge.control.node import CommandContext, Node, command
from meshforge.control.runtime import NodeRuntime
from meshforge.ops.observability import Metrics
from meshforge.store import open_store
from meshforge.transport.connection import connect

PRESENCE_INTERVAL = 10.0


class Appender:
    """Lines appended to one file with single ``O_APPEND`` writes (never interleaved)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def line(self, text: str) -> None:
        os.write(self.fd, f"{text} {time.time():.6f}\n".encode())


class BenchNode(Node):
    """``echo`` records its run (the command id) before it answers."""

    runs: Appender

    @command()
    async def echo(self, payload: dict[str, Any], ctx: CommandContext) -> Any:
        self.runs.line(ctx.command_id)
        return payload


async def serve(args: argparse.Namespace) -> None:
    out = Path(args.out)
    BenchNode.runs = Appender(out / f"runs-{args.first}.txt")
    ready = Appender(out / f"ready-{args.first}.txt")
    settings = load_settings({"nats_url": args.url}, env={})
    store = open_store(f"sqlite:///{out / f'nodes-{args.first}.db'}")
    conn = await connect(settings, name=f"bench-fleet-{args.first}")
    metrics = Metrics()  # one registry for the process's nodes, as one node process has
    gate = asyncio.Semaphore(args.concurrency)
    tasks: list[asyncio.Task[None]] = []  # held: a task nobody refers to may be collected

    async def start(index: int) -> None:
        name = f"n{index}"
        runtime = NodeRuntime(
            BenchNode(), args.site, name, conn, store, settings=settings,
            presence_interval=PRESENCE_INTERVAL, metrics=metrics,
        )  # fmt: skip
        tasks.append(asyncio.create_task(runtime.run()))
        await runtime.ready.wait()
        ready.line(name)

    async def gated(index: int) -> None:
        async with gate:
            await start(index)

    async def watch_lag() -> None:
        # A process too busy to read its socket in time looks, to its nodes, like a server
        # that stopped answering: said here, so the benchmark's warnings tell them apart.
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await asyncio.sleep(0.5)
            late = loop.time() - began - 0.5
            if late > 1.0:
                logging.warning("node process: event loop late by %.1fs", late)

    tasks.append(asyncio.create_task(watch_lag()))
    # The benchmark is over at SIGTERM: the process ends without stopping its nodes one by
    # one (10,000 last words, and a warning from each presence loop as the connection closes).
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, os._exit, 0)
    await asyncio.gather(*(gated(i) for i in range(args.first, args.first + args.count)))
    print(f"started {args.count} nodes", flush=True)
    await asyncio.Event().wait()  # until SIGTERM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url")
    parser.add_argument("site")
    parser.add_argument("first", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("out")
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)  # the warnings go to the log the benchmark counts
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
