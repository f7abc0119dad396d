"""Helpers for the consumer tests: settings, a running consumer, publishing, dead letters."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from meshforge.config import Settings, load_settings
from meshforge.consume.consumer import Consumer
from meshforge.envelope import Envelope
from meshforge.topology.provision import ensure
from meshforge.topology.specs import ConsumerSpec, agent_consumer, default_streams
from meshforge.topology.subjects import STREAM_FAILED
from meshforge.transport.connection import Connection, connect
from polling import wait_until


def settings(**values: object) -> Settings:
    """Settings from these values and defaults only (no environment, no file)."""
    return load_settings(values, env={})


def unique_agent() -> str:
    return f"a{uuid.uuid4().hex[:10]}"


def subject_for(agent: str, command: str = "do") -> str:
    return f"cmd.default.test.{agent}.{command}"


async def provision_all(js: JetStreamContext, s: Settings, *specs: ConsumerSpec) -> None:
    await ensure(js, default_streams(s), list(specs))


async def publish_envelopes(
    js: JetStreamContext, subject: str, count: int, **payload: Any
) -> list[Envelope]:
    envs = [Envelope.new("test.do", {"n": i, **payload}) for i in range(count)]
    for env in envs:
        await js.publish(subject, env.encode(), headers=env.headers())
    return envs


async def dead_letters(
    js: JetStreamContext, original_subject: str | None = None
) -> list[RawStreamMsg]:
    """Every message in MESHFORGE_FAILED (of one original subject)."""
    try:
        info = await js.stream_info(STREAM_FAILED)
    except NotFoundError:
        return []
    out: list[RawStreamMsg] = []
    if not info.state.messages:
        return out
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
        try:
            msg = await js.get_msg(STREAM_FAILED, seq)
        except NotFoundError:
            continue
        if original_subject is None or msg.subject == f"failed.{original_subject}":
            out.append(msg)
    return out


@contextlib.asynccontextmanager
async def running(
    consumer: Consumer, *, start_within: float = 10.0
) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``consumer`` in a task until the block ends; waits until it is ready."""
    task = asyncio.create_task(consumer.run())
    ready = asyncio.ensure_future(consumer.ready.wait())
    done, _ = await asyncio.wait(
        {task, ready}, timeout=start_within, return_when=asyncio.FIRST_COMPLETED
    )
    if task in done:
        ready.cancel()
        task.result()  # raises the start-up error
    if ready not in done:
        ready.cancel()
        task.cancel()
        raise AssertionError("consumer did not become ready")
    try:
        yield task
    finally:
        await consumer.stop(timeout=5.0)
        await asyncio.wait_for(task, 10.0)


@contextlib.asynccontextmanager
async def connection(url: str, name: str = "test") -> AsyncIterator[Connection]:
    conn = await connect(settings(), url=url, name=name)
    try:
        yield conn
    finally:
        await conn.close()


def counter_value(metric: Any, **labels: str) -> float:
    """The current value of a labelled counter or gauge."""
    return float(metric.labels(**labels)._value.get())


def histogram_count(metric: Any, **labels: str) -> float:
    child = metric.labels(**labels)
    return float(sum(b.get() for b in child._buckets))


__all__ = [
    "agent_consumer",
    "connection",
    "counter_value",
    "dead_letters",
    "histogram_count",
    "provision_all",
    "publish_envelopes",
    "running",
    "settings",
    "subject_for",
    "unique_agent",
    "wait_until",
]
