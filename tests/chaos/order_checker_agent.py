"""The order checker's agent: each resource's state is the list of command numbers applied.

A command ``step`` carries its number ``n`` and what to do, so the workload decides the
faults: ``fail`` (raise a plain error on the first k attempts), ``retry`` (return
``Retry(delay)`` on the first k attempts), ``sleep`` (a slow handler, seconds) and
``fatal`` (an unrecoverable error: dead-lettered, never applied). Attempts are counted in
a file per command under ``$ORDER_CHECKER_ATTEMPTS``, outside the store transaction, so
an attempt that was rolled back (or whose worker was killed) still counts.

Each applied command emits one event ``applied {"n", "at"}``: ``at`` is the length of
the state before it, so the events stream alone tells the applied order, whatever order
re-publishes after a crash put the events in.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec

from meshforge.envelope import Envelope
from meshforge.errors import Retry, Unrecoverable
from meshforge.runtime.agent import Agent, Event, command

AGENT = "chk"
ATTEMPTS_ENV = "ORDER_CHECKER_ATTEMPTS"


class Applied(msgspec.Struct):
    applied: list[int] = msgspec.field(default_factory=list)


class PlannedFailure(RuntimeError):
    """A transient failure the workload asked for (a plain exception, not ``Retry``)."""


def attempt(key: str) -> int:
    """This command's attempt number, counting this one (1 on the first)."""
    path = Path(os.environ[ATTEMPTS_ENV]) / key
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b".")  # one byte per attempt; O_APPEND keeps concurrent writers whole
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


class OrderCheckerAgent(Agent[Applied]):
    """``step {"n", "fail"?, "retry"?, "delay"?, "sleep"?, "fatal"?}``: append ``n`` to the state."""

    name = AGENT

    @command("step")
    async def step(self, cmd: Envelope, state: Applied) -> list[Event]:
        p = cmd.payload
        if p.get("fatal"):
            raise Unrecoverable(f"planned: command n={p['n']} can never succeed")
        tries = attempt(cmd.id)
        if tries <= int(p.get("fail", 0)):
            raise PlannedFailure(f"planned transient failure {tries} of n={p['n']}")
        if tries <= int(p.get("fail", 0)) + int(p.get("retry", 0)):
            raise Retry(f"planned retry of n={p['n']}", delay=float(p.get("delay", 0.2)))
        if p.get("sleep"):
            # A slow handler, not a wait: in_progress beats, hand-overs mid-flight.
            await asyncio.sleep(float(p["sleep"]))
        return [Event("applied", {"n": int(p["n"]), "at": len(state.applied)})]

    def apply(self, state: Applied, event: Event) -> Applied:
        return Applied(applied=[*state.applied, int(event.payload["n"])])
