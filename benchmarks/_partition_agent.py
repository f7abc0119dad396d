"""The agent of the partition benchmark: one event out per command, with the seq before it."""

from __future__ import annotations

import msgspec

from meshforge.envelope import Envelope
from meshforge.runtime.agent import Agent, Event, command


class Last(msgspec.Struct):
    seq: int = -1


class StepAgent(Agent[Last]):
    name = "bstep"

    @command("step")
    def step(self, cmd: Envelope, state: Last) -> list[Event]:
        return [Event("stepped", {"seq": cmd.payload["seq"], "after": state.seq})]

    def apply(self, state: Last, event: Event) -> Last:
        return Last(seq=int(event.payload["seq"]))
