"""Helpers for the fleet tests: many nodes run in-process, a controller as a child process,
and a whole site of nodes simulated by one consumer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

from control_testnode import RecordingNode

from meshforge.config import Settings, load_settings
from meshforge.control.reply import reply_envelope
from meshforge.control.runtime import NodeRuntime
from meshforge.envelope import decode
from meshforge.publish.publisher import Publisher
from meshforge.store import open_store
from meshforge.topology.subjects import STREAM_CONTROL, control_reply_subject
from meshforge.transport.connection import Connection, connect
from meshforge.transport.headers import text_headers

MESHFORGE = Path(sys.executable).parent / "meshforge"
HERE = Path(__file__).resolve().parent


class Fleet:
    """Nodes of ``RecordingNode`` run as tasks on one connection; ``start``/``stop`` each."""

    def __init__(self, nats_url: str, tmp: Path, **settings: object) -> None:
        self.settings: Settings = load_settings({"nats_url": nats_url, **settings})
        self.store = open_store(f"sqlite:///{tmp / 'fleet.db'}")
        self.conn: Connection | None = None
        self.running: dict[str, tuple[NodeRuntime, asyncio.Task[None]]] = {}

    async def __aenter__(self) -> Fleet:
        self.conn = await connect(self.settings, name="fleet-nodes")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for key in list(self.running):
            await self.stop(*key.split(".", 1))
        if self.conn is not None:
            await self.conn.close()
        self.store.close()

    async def start(self, site: str, node: str) -> NodeRuntime:
        assert self.conn is not None
        runtime = NodeRuntime(
            RecordingNode(), site, node, self.conn, self.store, settings=self.settings,
            presence_interval=1.0, probe_interval=3600.0,
        )  # fmt: skip
        task = asyncio.create_task(runtime.run())
        self.running[f"{site}.{node}"] = (runtime, task)
        await asyncio.wait_for(runtime.ready.wait(), 20)
        return runtime

    async def stop(self, site: str, node: str) -> None:
        runtime, task = self.running.pop(f"{site}.{node}")
        await runtime.stop(5)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


async def meshforge(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the ``meshforge`` command to its end; its exit code and output."""
    proc = await asyncio.create_subprocess_exec(
        str(MESHFORGE), *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


@contextlib.asynccontextmanager
async def child(
    *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``meshforge ARGS`` as a child process, killed at the end if still running."""
    proc = await asyncio.create_subprocess_exec(
        str(MESHFORGE), *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.returncode is None:  # SIGTERM first: a `meshforge server` stops its nats-server
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@contextlib.asynccontextmanager
async def simulated_site(conn: Connection, site: str) -> AsyncIterator[Counter[str]]:
    """Every node of ``site`` played by one consumer of its mailboxes: each command is
    answered ``ok`` at once. Yields how many times each command id was answered."""
    answered: Counter[str] = Counter()
    durable = f"sim_{site}"
    sub = await conn.js.pull_subscribe(f"control.cmd.{site}.>", durable, stream=STREAM_CONTROL)
    publisher = Publisher(conn.js)

    async def answer() -> None:
        while True:
            try:
                msgs = await sub.fetch(100, timeout=0.5)
            except TimeoutError:  # nats-py's own, or asyncio's from inside fetch
                continue
            for msg in msgs:
                command = decode(msg.data, text_headers(msg.headers))
                node = msg.subject.rsplit(".", 1)[1]
                reply = reply_envelope(
                    command, site=site, node=node, status="ok", result=None, error=None,
                    node_epoch=1,
                )  # fmt: skip
                await publisher.publish(control_reply_subject(site, node), reply)
                answered[command.id] += 1
                await msg.ack()

    task = asyncio.create_task(answer())
    try:
        yield answered
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # raises what stopped the answering early, if anything did
        await sub.unsubscribe()
        await conn.js.delete_consumer(STREAM_CONTROL, durable)
