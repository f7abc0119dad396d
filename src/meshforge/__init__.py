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
    from meshforge.connection import Connection, connect
    from meshforge.consumer import Consumer
    from meshforge.control import ControlClient, Node, NodeRuntime
    from meshforge.deadletter import DeadLetters, dead_letter
    from meshforge.decisions import Action, Decision, Delivery
    from meshforge.envelope import Envelope, Outbound, decode
    from meshforge.errors import (
        ConfigError,
        Expired,
        MalformedMessage,
        MeshForgeError,
        PublishError,
        Rejected,
        Retry,
        Unrecoverable,
    )
    from meshforge.inbox import with_inbox
    from meshforge.observability import Metrics
    from meshforge.outbox import OutboxRelay
    from meshforge.publisher import Publisher, PublishResult
    from meshforge.runtime import Agent, Engine, Event, Send, command, replay
    from meshforge.scope import Scope
    from meshforge.server import EmbeddedServer
    from meshforge.store import open_store
    from meshforge.sync_publisher import SyncPublisher
    from meshforge.topology import agent_consumer, default_streams, ensure, node_consumer, verify

_WHERE = {
    "Settings": "config",
    "load_settings": "config",
    "Connection": "connection",
    "connect": "connection",
    "Consumer": "consumer",
    "ControlClient": "control",
    "Node": "control",
    "NodeRuntime": "control",
    "DeadLetters": "deadletter",
    "dead_letter": "deadletter",
    "Action": "decisions",
    "Decision": "decisions",
    "Delivery": "decisions",
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
    "with_inbox": "inbox",
    "Metrics": "observability",
    "OutboxRelay": "outbox",
    "Publisher": "publisher",
    "PublishResult": "publisher",
    "Agent": "runtime",
    "Engine": "runtime",
    "Event": "runtime",
    "Send": "runtime",
    "command": "runtime",
    "replay": "runtime",
    "EmbeddedServer": "server",
    "Scope": "scope",
    "open_store": "store",
    "SyncPublisher": "sync_publisher",
    "agent_consumer": "topology",
    "default_streams": "topology",
    "ensure": "topology",
    "node_consumer": "topology",
    "verify": "topology",
}

__all__ = [
    "Action",
    "Agent",
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
