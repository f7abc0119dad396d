"""The agent runtime: write an agent, run it with exactly-once effects, replay its log.

Example::

    from meshforge.runtime import Agent, Event, Send, command

    class OrderAgent(Agent[OrderState]):
        name = "order"

        @command("create", key="order_id")
        def create(self, cmd, state):
            return [Event("created", cmd.payload), Send("inventory", "reserve", cmd.payload)]

Run it with ``meshforge run mymodule:OrderAgent``; ``meshforge replay order`` prints its
event count and state hash.
"""

from __future__ import annotations

from typing import Any

from meshforge.runtime.agent import (
    SINGLETON,
    Agent,
    Command,
    CommandSpec,
    Event,
    Output,
    Send,
    command,
    command_for,
    derive_uuid,
)

__all__ = [
    "SINGLETON",
    "Agent",
    "Command",
    "CommandSpec",
    "Engine",
    "Event",
    "Output",
    "ReplayResult",
    "Send",
    "Worker",
    "command",
    "command_for",
    "derive_uuid",
    "load_agent",
    "replay",
    "state_hash",
]

_LAZY = {
    "Engine": "meshforge.runtime.engine",
    "Worker": "meshforge.runtime.worker",
    "load_agent": "meshforge.runtime.worker",
    "ReplayResult": "meshforge.runtime.replay",
    "replay": "meshforge.runtime.replay",
    "state_hash": "meshforge.runtime.replay",
}


def __getattr__(name: str) -> Any:
    # The engine and worker pull in NATS and the store: loaded only when asked for.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshforge.runtime' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
