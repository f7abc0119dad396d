"""The durable command-reply control plane: node mailboxes on JetStream, run-once replies.

An operator drops a command into ``control.cmd.<site>.<node>``; the node pulls it
whenever it is up, runs it once and replies on ``control.reply.<site>.<node>``.

Example::

    from meshforge.control import ControlClient, Node, NodeRuntime, command

    ctl = ControlClient(conn)
    command_id = await ctl.send("lab1", "node7", "echo", {"hi": 1}, deadline="5m")
    reply = await ctl.wait_reply("lab1", "node7", command_id, timeout=10)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshforge.control.client import ControlClient, NodeStatus, node_durable, to_timestamp
    from meshforge.control.fleet import NodeRow, list_nodes
    from meshforge.control.jobs import JobSpec, JobStore, NodeJob
    from meshforge.control.node import CommandContext, CommandHandler, Node, command, load_node
    from meshforge.control.presence import (
        NODES_BUCKET,
        Announcement,
        Presence,
        read_announcement,
    )
    from meshforge.control.reply import REPLY_TYPE, Reply, Status, reply_envelope
    from meshforge.control.rollout import JobController
    from meshforge.control.runtime import NodeRuntime
    from meshforge.control.sites import link_site

# Where each public name lives; imported on first use so that writing a Node does not
# pull in the consumer and publisher.
_WHERE = {
    "ControlClient": "client",
    "NodeStatus": "client",
    "node_durable": "client",
    "to_timestamp": "client",
    "CommandContext": "node",
    "CommandHandler": "node",
    "Node": "node",
    "command": "node",
    "load_node": "node",
    "NODES_BUCKET": "presence",
    "Announcement": "presence",
    "Presence": "presence",
    "read_announcement": "presence",
    "REPLY_TYPE": "reply",
    "Reply": "reply",
    "Status": "reply",
    "reply_envelope": "reply",
    "NodeRuntime": "runtime",
    "NodeRow": "fleet",
    "list_nodes": "fleet",
    "JobSpec": "jobs",
    "JobStore": "jobs",
    "NodeJob": "jobs",
    "JobController": "rollout",
    "link_site": "sites",
}

__all__ = [
    "NODES_BUCKET",
    "REPLY_TYPE",
    "Announcement",
    "CommandContext",
    "CommandHandler",
    "ControlClient",
    "JobController",
    "JobSpec",
    "JobStore",
    "Node",
    "NodeJob",
    "NodeRow",
    "NodeRuntime",
    "NodeStatus",
    "Presence",
    "Reply",
    "Status",
    "command",
    "link_site",
    "list_nodes",
    "load_node",
    "node_durable",
    "read_announcement",
    "reply_envelope",
    "to_timestamp",
]


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'meshforge.control' has no attribute {name!r}")
    return getattr(importlib.import_module(f"meshforge.control.{module}"), name)
