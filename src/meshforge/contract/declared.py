"""What agents and nodes declare about their messages, read from their classes.

An agent's commands are its ``@command`` methods, each with its payload type (None: a
plain dict). Its events are those named in ``Agent.events`` (with their payload types)
and, for events that stay dicts, those its class builds with a literal name:
``Event("created", {...})`` in any of its methods. A node's commands are its
``@command`` methods and those added with ``add_command``; their payloads are dicts.

Example::

    declared = agent_messages(OrderAgent)
    [c.name for c in declared.commands]   # ['create', 'get']
    [e.name for e in declared.events]     # ['created', 'not_found', 'found']
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from meshforge.control.node import Node
from meshforge.runtime.agent import Agent

__all__ = ["AgentMessages", "Message", "NodeMessages", "agent_messages", "node_messages"]

# A subject token (CONTRACT.md): a literal that is not one never reaches a subject.
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class Message:
    """One declared command or event: its name, payload type (None: a dict) and description."""

    name: str
    payload: type | None
    description: str


@dataclass(frozen=True, slots=True)
class AgentMessages:
    """An agent's name, description, the commands it handles and the events it emits."""

    name: str
    description: str
    commands: tuple[Message, ...]
    events: tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class NodeMessages:
    """A node class's name, description and the commands it runs."""

    name: str
    description: str
    commands: tuple[Message, ...]


def _doc(obj: object) -> str:
    """``obj``'s own docstring, cleaned: a class without one does not show its base's."""
    text = vars(obj).get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return inspect.cleandoc(text) if isinstance(text, str) else ""


def agent_messages(agent: Agent[Any] | type[Agent[Any]]) -> AgentMessages:
    """What ``agent`` (a class or an instance) declares."""
    cls = agent if isinstance(agent, type) else type(agent)
    commands = tuple(
        Message(spec.name, spec.payload, _doc(spec.handler)) for spec in cls.commands().values()
    )
    typed: dict[str, type] = dict(cls.events)
    names = [*typed, *(name for name in _literal_events(cls) if name not in typed)]
    events = tuple(Message(name, typed.get(name), "") for name in dict.fromkeys(names))
    return AgentMessages(cls.name, _doc(cls), commands, events)


def node_messages(node: Node) -> NodeMessages:
    """What ``node`` (an instance, so that commands added at run time count) runs."""
    commands = tuple(Message(name, None, _doc(node.handler_for(name))) for name in node.commands())
    return NodeMessages(type(node).__name__, _doc(type(node)), commands)


def _literal_events(cls: type) -> Iterator[str]:
    """The names of ``Event("name", ...)`` built in the agent's own classes, in source order."""
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, Agent)) or klass is Agent:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue  # defined where no source is kept (a REPL, exec): typed events only
        calls = sorted(
            (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)),
            key=lambda n: (n.lineno, n.col_offset),
        )
        for call in calls:
            name = _event_name(call)
            if name is not None and _TOKEN.fullmatch(name):
                yield name


def _event_name(node: ast.Call) -> str | None:
    func = node.func
    called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if called != "Event":
        return None
    first: ast.expr | None = node.args[0] if node.args else None
    for keyword in node.keywords:
        if keyword.arg == "name":
            first = keyword.value
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None
