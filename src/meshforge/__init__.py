"""MeshForge: reliable messaging on NATS JetStream with exactly-once effects.

The public API, re-exported; each name is imported on first use so that
``import meshforge`` stays cheap.

Example::

    import meshforge

    async with await meshforge.connect(url="nats://127.0.0.1:4222") as conn:
        publisher = meshforge.Publisher(conn.js)
        env = meshforge.Envelope.new("order.create", {"sku": "A-1", "qty": 2})
        await publisher.publish("cmd.default.demo.order.create", env)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from meshforge.config import Settings, load_settings
    from meshforge.consume.consumer import Consumer
    from meshforge.consume.decisions import Action, Decision, Delivery
    from meshforge.consume.inbox import with_inbox
    from meshforge.control import ControlClient, Node, NodeRuntime
    from meshforge.deadletters.admin import DeadLetters
    from meshforge.deadletters.route import dead_letter
    from meshforge.envelope import Envelope, Outbound, decode
    from meshforge.errors import (
        ConfigError,
        Expired,
        InvalidPayload,
        MalformedMessage,
        MeshForgeError,
        PublishError,
        Rejected,
        Retry,
        Unrecoverable,
    )
    from meshforge.ops.observability import Metrics
    from meshforge.publish.outbox import OutboxRelay
    from meshforge.publish.publisher import Publisher, PublishResult
    from meshforge.publish.sync import SyncPublisher
    from meshforge.runtime import Agent, Command, Engine, Event, Send, command, replay
    from meshforge.store import open_store
    from meshforge.topology.provision import ensure, verify
    from meshforge.topology.scope import Scope
    from meshforge.topology.specs import agent_consumer, default_streams, node_consumer
    from meshforge.transport.connection import Connection, connect
    from meshforge.transport.server import EmbeddedServer

_WHERE = {
    "Settings": "config",
    "load_settings": "config",
    "Connection": "transport.connection",
    "connect": "transport.connection",
    "Consumer": "consume.consumer",
    "ControlClient": "control",
    "Node": "control",
    "NodeRuntime": "control",
    "DeadLetters": "deadletters.admin",
    "dead_letter": "deadletters.route",
    "Action": "consume.decisions",
    "Decision": "consume.decisions",
    "Delivery": "consume.decisions",
    "Envelope": "envelope",
    "Outbound": "envelope",
    "decode": "envelope",
    "ConfigError": "errors",
    "Expired": "errors",
    "MalformedMessage": "errors",
    "MeshForgeError": "errors",
    "PublishError": "errors",
    "Rejected": "errors",
    "Retry": "errors",
    "Unrecoverable": "errors",
    "InvalidPayload": "errors",
    "with_inbox": "consume.inbox",
    "Metrics": "ops.observability",
    "OutboxRelay": "publish.outbox",
    "Publisher": "publish.publisher",
    "PublishResult": "publish.publisher",
    "Agent": "runtime",
    "Command": "runtime",
    "Engine": "runtime",
    "Event": "runtime",
    "Send": "runtime",
    "command": "runtime",
    "replay": "runtime",
    "EmbeddedServer": "transport.server",
    "Scope": "topology.scope",
    "open_store": "store",
    "SyncPublisher": "publish.sync",
    "agent_consumer": "topology.specs",
    "default_streams": "topology.specs",
    "ensure": "topology.provision",
    "node_consumer": "topology.specs",
    "verify": "topology.provision",
}

__all__ = [
    "Action",
    "Agent",
    "Command",
    "ConfigError",
    "Connection",
    "Consumer",
    "ControlClient",
    "DeadLetters",
    "Decision",
    "Delivery",
    "EmbeddedServer",
    "Engine",
    "Envelope",
    "Event",
    "Expired",
    "InvalidPayload",
    "MalformedMessage",
    "MeshForgeError",
    "Metrics",
    "Node",
    "NodeRuntime",
    "Outbound",
    "OutboxRelay",
    "PublishError",
    "PublishResult",
    "Publisher",
    "Rejected",
    "Retry",
    "Scope",
    "Send",
    "Settings",
    "SyncPublisher",
    "Unrecoverable",
    "agent_consumer",
    "command",
    "connect",
    "dead_letter",
    "decode",
    "default_streams",
    "ensure",
    "load_settings",
    "node_consumer",
    "open_store",
    "replay",
    "verify",
    "with_inbox",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'meshforge' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"meshforge.{module}"), name)
    globals()[name] = value
    return value
