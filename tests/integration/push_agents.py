"""An agent for the push tests: its events name the worker process that handled the command."""

from __future__ import annotations

import os

import msgspec

from meshforge.envelope import Envelope
from meshforge.runtime.agent import Agent, Event, command


class Seen(msgspec.Struct):
    times: int = 0


class TallyAgent(Agent[Seen]):
    name = "tally"

    @command("count", key="n")
    def count(self, cmd: Envelope, state: Seen) -> list[Event]:
        # Not deterministic on purpose: the test wants to know which worker ran it.
        return [
            Event("counted", {"n": cmd.payload["n"], "pid": os.getpid(), "before": state.times})
        ]

    def apply(self, state: Seen, event: Event) -> Seen:
        return Seen(times=state.times + 1)
