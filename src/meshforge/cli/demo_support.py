"""What ``meshforge demo`` (and the crash suite) use to drive agents from outside.

``AgentProcess`` runs ``meshforge run`` as a child process that can be killed with
SIGKILL and started again; ``read_stream`` reads a stream range over the wire;
``EventWatch`` sees every event as it is published (re-publishes included).

Example::

    proc = AgentProcess("meshforge.demo:OrderAgent", store_url, nats_url, log_path)
    proc.start()
    proc.kill()          # SIGKILL: no goodbye, no ack
    proc.start()         # the run goes on
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from meshforge.envelope import Envelope, decode
from meshforge.errors import MalformedMessage

__all__ = ["AgentProcess", "EventWatch", "StreamMessage", "meshforge_command", "read_stream"]


def meshforge_command(*args: str) -> list[str]:
    """The argv that runs ``meshforge ARGS`` with this interpreter (no PATH needed)."""
    return [sys.executable, "-c", "from meshforge.cli import main; main()", *args]


class AgentProcess:
    """``meshforge run SPEC`` as a child process with its output in ``log_path``."""

    def __init__(
        self,
        spec: str | list[str],
        store_url: str,
        nats_url: str,
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.specs = [spec] if isinstance(spec, str) else list(spec)
        self.store_url = store_url
        self.nats_url = nats_url
        self.log_path = log_path
        self.env = dict(env or {})
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log: IO[bytes] | None = None

    def start(self, env: Mapping[str, str] | None = None) -> None:
        """Start (again); ``env`` adds variables for this start only."""
        if self.alive:
            raise RuntimeError(f"{self.specs} is already running")
        full_env = {**os.environ, "MESHFORGE_LOG_LEVEL": "WARNING", **self.env, **(env or {})}
        if "MESHFORGE_CRASH_AT" not in self.env and "MESHFORGE_CRASH_AT" not in (env or {}):
            full_env.pop("MESHFORGE_CRASH_AT", None)
        args = meshforge_command(
            "run",
            *self.specs,
            "--store",
            self.store_url,
            "--nats-url",
            self.nats_url,
            *self.extra_args,
        )
        self._close_log()
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
        self.starts += 1

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful), SIGKILL if it does not end within ``timeout``; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_log()
        return self.proc.returncode

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass(frozen=True, slots=True)
class StreamMessage:
    """One stored message: where it is and what it says."""

    subject: str
    seq: int
    headers: dict[str, str]
    data: bytes

    def envelope(self) -> Envelope | None:
        try:
            return decode(self.data, self.headers)
        except MalformedMessage:
            return None


async def read_stream(
    js: JetStreamContext,
    stream: str,
    subject: str,
    start_seq: int = 1,
    *,
    batch: int = 1000,
    fetch_wait: float = 2.0,
) -> list[StreamMessage]:
    """Every message of ``stream`` matching ``subject`` from ``start_seq`` to the current end."""
    info = await js.stream_info(stream)
    last = info.state.last_seq
    if last < start_seq:
        return []
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start_seq,
        ack_policy=AckPolicy.NONE,
        filter_subject=subject,
        inactive_threshold=30.0,
    )
    sub = await js.pull_subscribe(subject, stream=stream, config=config)
    out: list[StreamMessage] = []
    deadline = time.monotonic() + max(30.0, 10 * fetch_wait)
    try:
        while True:
            try:
                msgs = await sub.fetch(batch, timeout=fetch_wait)
            except TimeoutError:  # nats-py raises its own, or asyncio's when its deadline passed
                # A slow server (a replica catching up, a busy machine) is not the end of the stream.
                try:
                    left = (await sub.consumer_info()).num_pending
                except Exception:  # e.g. the consumer's leader moving: ask again
                    left = None
                if left == 0:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"reading {stream} ({subject}) stalled with messages left"
                    ) from None
                continue
            for m in msgs:
                out.append(
                    StreamMessage(
                        m.subject, m.metadata.sequence.stream, dict(m.headers or {}), m.data
                    )
                )
            if msgs and (
                msgs[-1].metadata.num_pending == 0 or msgs[-1].metadata.sequence.stream >= last
            ):
                break
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return out


class EventWatch:
    """Every message published on a subject, as sent (a re-publish the stream drops is seen too)."""

    def __init__(self) -> None:
        self.seen: list[Envelope] = []
        self._changed = asyncio.Event()
        self._sub: Subscription | None = None
        self.on_event: Callable[[Envelope], Any] | None = None

    async def start(self, nc: NATS, subject: str) -> None:
        async def on_msg(msg: Msg) -> None:
            try:
                env = decode(msg.data, dict(msg.headers or {}))
            except MalformedMessage:
                return
            self.seen.append(env)
            if self.on_event is not None:
                self.on_event(env)
            self._changed.set()

        self._sub = await nc.subscribe(subject, cb=on_msg, pending_msgs_limit=2_000_000,
                                       pending_bytes_limit=1 << 30)  # fmt: skip

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def wait_for(
        self, predicate: Callable[[Envelope], bool], within: float, *, after: int = 0
    ) -> Envelope:
        """The first event (from index ``after``) matching ``predicate`` within ``within``
        seconds; TimeoutError if none."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        index = after
        while True:
            while index < len(self.seen):
                if predicate(self.seen[index]):
                    return self.seen[index]
                index += 1
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError("no matching event")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
