"""The project spec of ``meshforge init --from``: agents, their commands and their events.

A short YAML file, checked whole before anything is written; each mistake is one line
naming where it is::

    agents:
      - name: order
        key: order_id            # payload field naming the resource (default <name>_id)
        commands:
          - name: create
            fields: {sku: str, qty: int, note: str | None}
            events: [created]
          - name: cancel
            events: [cancelled]

Each command's payload is a ``msgspec.Struct`` of its ``fields`` (the key first, a ``str``
unless the fields say ``int``); each event's is a Struct of the fields of the command that
emits it. A field's type is ``str``, ``int``, ``float``, ``bool`` or ``list[...]`` of one
of them, and ``... | None`` makes it optional (default None).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshforge.errors import ConfigError

__all__ = ["AgentSpec", "CommandSpec", "FieldSpec", "ProjectSpec", "default_spec", "load_spec"]

# Lower-case Python identifiers: each becomes a subject token, a method and a module name.
_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_KEYWORDS = frozenset({"and", "as", "class", "def", "del", "for", "from", "global", "if", "import",
                       "in", "is", "not", "or", "pass", "return", "try", "while", "with", "yield",
                       "none", "true", "false", "async", "await", "lambda", "raise", "assert",
                       "break", "continue", "elif", "else", "except", "finally", "nonlocal"})  # fmt: skip
# Methods of Agent a command must not shadow.
_RESERVED = frozenset({"apply", "handle", "initial", "commands", "resource_key", "encode_state",
                       "decode_state", "name", "state_type", "unrecoverable", "events",
                       "timeout"})  # fmt: skip
# A field's type: a JSON scalar, a list of one, either optional.
_TYPE = re.compile(
    r"(?P<type>str|int|float|bool|list\[(?:str|int|float|bool)\])(?P<optional> \| None)?"
)


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """A payload field: its name and its Python type as written (``str``, ``int | None``)."""

    name: str
    type: str

    @property
    def optional(self) -> bool:
        return self.type.endswith(" | None")


@dataclass(frozen=True, slots=True)
class CommandSpec:
    name: str
    events: tuple[str, ...]
    fields: tuple[FieldSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class AgentSpec:
    name: str
    key: str
    commands: tuple[CommandSpec, ...]

    @property
    def class_name(self) -> str:
        """``order_line`` -> ``OrderLineAgent``."""
        return _pascal(self.name) + "Agent"

    @property
    def state_name(self) -> str:
        return self.class_name.removesuffix("Agent") + "State"

    def command_struct(self, command: CommandSpec) -> str:
        """The payload type of a command: ``create`` of ``order`` -> ``CreateOrder``."""
        return _pascal(command.name) + _pascal(self.name)

    def event_struct(self, event: str) -> str:
        """The payload type of an event: ``created`` of ``order`` -> ``OrderCreated``."""
        return _pascal(self.name) + _pascal(event)

    def payload_fields(self, command: CommandSpec) -> tuple[FieldSpec, ...]:
        """A command's fields with its key first (a ``str`` unless the fields say ``int``)."""
        given = {f.name: f for f in command.fields}
        key = given.pop(self.key, FieldSpec(self.key, "str"))
        return (key, *given.values())

    def events(self) -> dict[str, CommandSpec]:
        """Each event of the agent and the (first) command that emits it."""
        found: dict[str, CommandSpec] = {}
        for command in self.commands:
            for event in command.events:
                found.setdefault(event, command)
        return found


@dataclass(frozen=True, slots=True)
class ProjectSpec:
    agents: tuple[AgentSpec, ...]


def default_spec() -> ProjectSpec:
    """What ``meshforge init`` writes without ``--from``: one agent, one command, its events."""
    create = CommandSpec(
        "create",
        ("created",),
        (FieldSpec("sku", "str"), FieldSpec("qty", "int"), FieldSpec("note", "str | None")),
    )
    return ProjectSpec((AgentSpec("order", "order_id", (create,)),))


def load_spec(path: Path) -> ProjectSpec:
    """Read and check a spec file; raises ``ConfigError`` with one line naming the mistake."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: spec file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the spec: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not YAML"
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    return parse_spec(data, str(path))


def parse_spec(data: Any, label: str = "spec") -> ProjectSpec:
    """The spec from already-parsed YAML (a mapping with ``agents``)."""
    root = _mapping(data, label, {"agents"}, required=("agents",))
    agents = tuple(
        _agent(item, f"{label}: agents[{i}]")
        for i, item in enumerate(_list(root["agents"], f"{label}: agents"))
    )
    _unique([a.name for a in agents], f"{label}: agents", "agent")
    return ProjectSpec(agents)


def _agent(data: Any, where: str) -> AgentSpec:
    item = _mapping(data, where, {"name", "key", "commands"}, required=("name", "commands"))
    name = _name(item["name"], f"{where}.name")
    key = _name(item.get("key", f"{name}_id"), f"{where}.key")
    commands = tuple(
        _command(c, f"{where}.commands[{i}]")
        for i, c in enumerate(_list(item["commands"], f"{where}.commands"))
    )
    _unique([c.name for c in commands], f"{where}.commands", "command")
    agent = AgentSpec(name, key, commands)
    _check_payloads(agent, where)
    return agent


def _command(data: Any, where: str) -> CommandSpec:
    item = _mapping(data, where, {"name", "events", "fields"}, required=("name", "events"))
    name = _name(item["name"], f"{where}.name")
    if name in _RESERVED:
        raise ConfigError(
            f"{where}.name: {name!r} is reserved by Agent; choose another command name"
        )
    events = tuple(
        _name(e, f"{where}.events[{i}]")
        for i, e in enumerate(_list(item["events"], f"{where}.events"))
    )
    _unique(list(events), f"{where}.events", "event")
    return CommandSpec(name, events, _fields(item.get("fields", {}), f"{where}.fields"))


def _fields(data: Any, where: str) -> tuple[FieldSpec, ...]:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of field name to type, got {_kind(data)}")
    fields = []
    for name, kind in data.items():
        _name(name, f"{where}: field name")
        if not isinstance(kind, str) or not _TYPE.fullmatch(kind.strip()):
            raise ConfigError(
                f"{where}.{name}: expected str, int, float, bool or list[...] of one, "
                f"optionally '| None', got {kind!r}"
            )
        fields.append(FieldSpec(name, kind.strip()))
    return tuple(fields)


def _check_payloads(agent: AgentSpec, where: str) -> None:
    """The key is a required ``str`` or ``int``; an event emitted by two commands gets the
    same fields from both; no generated class name is taken twice."""
    for i, command in enumerate(agent.commands):
        key = agent.payload_fields(command)[0]
        if key.type not in ("str", "int"):
            raise ConfigError(
                f"{where}.commands[{i}].fields.{key.name}: the key {key.name!r} must be str or "
                f"int, got {key.type!r}"
            )
    events = agent.events()
    for command in agent.commands:
        for event in command.events:
            first = events[event]
            if agent.payload_fields(first) != agent.payload_fields(command):
                raise ConfigError(
                    f"{where}: event {event!r} comes from commands {first.name!r} and "
                    f"{command.name!r} with different fields; give them the same fields or "
                    "name the events apart"
                )
    names = [agent.class_name, agent.state_name]
    names += [agent.command_struct(c) for c in agent.commands]
    names += [agent.event_struct(e) for e in events]
    _unique(names, f"{where}: generated classes", "class")


def _mapping(data: Any, where: str, allowed: set[str], required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where}: expected a mapping with {', '.join(required)}, got {_kind(data)}"
        )
    unknown = sorted(str(k) for k in set(data) - allowed)
    if unknown:
        raise ConfigError(
            f"{where}: unknown field {unknown[0]!r}; known: {', '.join(sorted(allowed))}"
        )
    for name in required:
        if name not in data:
            raise ConfigError(f"{where}: missing {name!r}")
    return data


def _list(data: Any, where: str) -> list[Any]:
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{where}: expected a non-empty list, got {_kind(data)}")
    return data


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value) or value in _KEYWORDS:
        raise ConfigError(
            f"{where}: expected a lower-case name (a-z, 0-9, _; starting with a letter), got {value!r}"
        )
    return value


def _unique(names: list[str], where: str, what: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ConfigError(f"{where}: {what} {name!r} appears twice")
        seen.add(name)


def _pascal(name: str) -> str:
    """``cancel_requested`` -> ``CancelRequested``."""
    return "".join(part.capitalize() for part in name.split("_"))


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, list) and not value:
        return "an empty list"
    return f"{type(value).__name__} {value!r}"[:80]
