"""The project spec of ``meshforge init --from``: agents, their commands and their events.

A short YAML file, checked whole before anything is written; each mistake is one line
naming where it is::

    agents:
      - name: order
        key: order_id            # payload field naming the resource (default <name>_id)
        commands:
          - name: create
            events: [created]
          - name: cancel
            events: [cancelled]
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshforge.errors import ConfigError

__all__ = ["AgentSpec", "CommandSpec", "ProjectSpec", "default_spec", "load_spec"]

# Lower-case Python identifiers: each becomes a subject token, a method and a module name.
_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_KEYWORDS = frozenset({"and", "as", "class", "def", "del", "for", "from", "global", "if", "import",
                       "in", "is", "not", "or", "pass", "return", "try", "while", "with", "yield",
                       "none", "true", "false", "async", "await", "lambda", "raise", "assert",
                       "break", "continue", "elif", "else", "except", "finally", "nonlocal"})  # fmt: skip
# Methods of Agent a command must not shadow.
_RESERVED = frozenset({"apply", "handle", "initial", "commands", "resource_key", "encode_state",
                       "decode_state", "name", "state_type", "unrecoverable"})  # fmt: skip


@dataclass(frozen=True, slots=True)
class CommandSpec:
    name: str
    events: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AgentSpec:
    name: str
    key: str
    commands: tuple[CommandSpec, ...]

    @property
    def class_name(self) -> str:
        """``order_line`` -> ``OrderLineAgent``."""
        return "".join(part.capitalize() for part in self.name.split("_")) + "Agent"

    @property
    def state_name(self) -> str:
        return self.class_name.removesuffix("Agent") + "State"


@dataclass(frozen=True, slots=True)
class ProjectSpec:
    agents: tuple[AgentSpec, ...]


def default_spec() -> ProjectSpec:
    """What ``meshforge init`` writes without ``--from``: one agent, one command, its events."""
    return ProjectSpec((AgentSpec("order", "order_id", (CommandSpec("create", ("created",)),)),))


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
    return AgentSpec(name, key, commands)


def _command(data: Any, where: str) -> CommandSpec:
    item = _mapping(data, where, {"name", "events"}, required=("name", "events"))
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
    return CommandSpec(name, events)


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


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, list) and not value:
        return "an empty list"
    return f"{type(value).__name__} {value!r}"[:80]
