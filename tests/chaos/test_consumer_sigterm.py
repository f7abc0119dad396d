"""SIGTERM to a consumer process with messages in flight loses none.

Each message is either finished and acked by the stopping process, or nak'ed by it and
finished by the next process, promptly (well inside the 30 s ack wait, so nothing was
left hanging), and none is finished by both.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from consumer_chaos import settings
from nats.js import JetStreamContext

from meshforge.envelope import Envelope
from meshforge.topology.provision import ensure
from meshforge.topology.specs import agent_consumer, default_streams
from meshforge.topology.subjects import STREAM_COMMANDS
from polling import wait_until

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "consumer_worker.py"
COUNT = 24


class Worker:
    def __init__(self, url: str, agent: str, log: Path, seconds: float, shutdown: float) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), url, agent, str(log), str(seconds), str(shutdown)],
            stdout=subprocess.DEVNULL,
            stderr=(log.with_suffix(".err")).open("wb"),
        )

    def lines(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [line.split() for line in self.log.read_text().splitlines() if line.strip()]

    def started(self) -> list[int]:
        return [int(p[1]) for p in self.lines() if p[0] == "start"]

    def done(self) -> list[int]:
        return [int(p[1]) for p in self.lines() if p[0] == "done"]

    def has(self, word: str) -> bool:
        return any(p == [word] for p in self.lines())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.parametrize(
    ("handler_seconds", "shutdown_timeout", "finishes"),
    [(0.4, 10.0, True), (3.0, 0.2, False)],
    ids=["in-flight-finish", "in-flight-nak"],
)
async def test_sigterm_with_messages_in_flight_loses_none(
    nats_url: str,
    js: JetStreamContext,
    tmp_path: Path,
    handler_seconds: float,
    shutdown_timeout: float,
    finishes: bool,
) -> None:
    s = settings()
    agent = f"sig{int(time.time() * 1000) % 10**8}{'f' if finishes else 'n'}"
    spec = agent_consumer(agent, settings(ack_wait=30, backoff="30s"))
    await ensure(js, default_streams(s), [spec])
    subject = f"cmd.default.chaos.{agent}.do"
    for n in range(COUNT):
        env = Envelope.new(f"{agent}.do", {"n": n})
        await js.publish(subject, env.encode(), headers=env.headers())

    first = Worker(nats_url, agent, tmp_path / "first.log", handler_seconds, shutdown_timeout)
    second: Worker | None = None
    try:
        await wait_until(lambda: len(first.started()) >= 4, timeout=20, what="work in flight")
        in_flight = set(first.started()) - set(first.done())
        assert in_flight, "SIGTERM must arrive with messages in flight"
        first.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(first.proc.wait, 20)
        assert code == 0 and first.has("exit")
        done_first = set(first.done())
        if finishes:
            assert in_flight <= done_first  # finished within the shutdown timeout, then acked
        else:
            assert not (in_flight & done_first)  # could not finish: nak'ed

        restarted = time.monotonic()
        second = Worker(nats_url, agent, tmp_path / "second.log", 0.05, 10.0)
        await wait_until(
            lambda: done_first | set(second.done()) == set(range(COUNT)),  # type: ignore[union-attr]
            timeout=20,
            what="every message finished",
        )
        # Far inside the 30 s ack wait: nothing was abandoned without a nak.
        assert time.monotonic() - restarted < 20
        assert not (done_first & set(second.done())), "a finished message was processed twice"
        if not finishes:
            redelivered = {int(p[1]) for p in second.lines() if p[0] == "start" and p[2] != "1"}
            assert in_flight <= redelivered

        async def drained() -> bool:
            info = await js.consumer_info(STREAM_COMMANDS, spec.durable)
            return info.num_ack_pending == 0 and info.num_pending == 0

        await wait_until(drained, timeout=10, what="the consumer to be drained")
    finally:
        first.stop()
        if second is not None:
            second.stop()
