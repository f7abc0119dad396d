"""An agent for the partition tests: each event says what the resource had seen before."""

from __future__ import annotations

import asyncio
import os

import msgspec

from meshforge.envelope import Envelope
from meshforge.errors import Retry
from meshforge.runtime.agent import Agent, Event, command


class Seen(msgspec.Struct):
    last: int = -1
    count: int = 0


def _first(flag: str) -> bool:
    """Whether this is the first attempt of all workers (it creates the file ``flag``)."""
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class SequenceAgent(Agent[Seen]):
    """``step {"seq", "pause"?, "retry_once"?, "retry"?}`` on a resource: emits ``stepped``
    with the seq before it. ``retry_once`` names a file: the first attempt in any worker
    creates it and returns ``Retry(delay=retry)`` (a head nak'ed past the ack wait)."""

    name = "seq"

    @command("step")
    async def step(self, cmd: Envelope, state: Seen) -> list[Event]:
        pause = float(cmd.payload.get("pause", 0))
        if pause:
            await asyncio.sleep(pause)  # a handler that takes time, so a kill lands mid-flight
        flag = cmd.payload.get("retry_once")
        if flag and _first(flag):
            raise Retry("not yet", delay=float(cmd.payload.get("retry", 1)))
        # The pid is not deterministic on purpose: the test wants to know which worker ran it.
        return [
            Event("stepped", {"seq": cmd.payload["seq"], "after": state.last, "pid": os.getpid()})
        ]

    def apply(self, state: Seen, event: Event) -> Seen:
        return Seen(last=int(event.payload["seq"]), count=state.count + 1)
