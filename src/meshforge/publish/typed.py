"""Typed sending: the command of an agent that takes a payload's type, and the payload as
the JSON a command carries.

A sender names the agent class and hands over a typed payload (a ``msgspec.Struct``, a
dataclass or a Pydantic v2 model); the agent's declaration (``cmd: Command[P]``, or
``@command(..., payload=P)``) says which of its commands takes that type, so the subject
and the envelope type come from the declaration and cannot be mistyped. The resolver sits
here, below the runtime, because the publishers need it as much as ``Send.to`` does; it
reads only what every agent class offers (``name`` and ``commands()``).

The publishers send what ``addressed`` builds: the subject from the declaration (with its
partition token when the deployment partitions) and a new envelope around the payload's
fields. Only the subject is checked here; the worker decodes the values (a Struct's
constructor checks neither types nor constraints) and dead-letters a payload that does not
fit as ``invalid_payload`` (``meshforge publish --agent`` checks before it sends).

Example::

    command_for(OrderAgent, PlaceOrder(order_id="o-1", qty=2))   # ("order", "place")
    to_builtins(PlaceOrder(order_id="o-1", qty=2))               # {'order_id': 'o-1', 'qty': 2}
    subject, env = addressed(OrderAgent, PlaceOrder(order_id="o-1", qty=2), settings)
    # cmd.default.default.order.place, an Envelope of type order.place, resource_id "o-1"
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, cast

import msgspec

from meshforge.config import Settings
from meshforge.envelope import Envelope
from meshforge.errors import ConfigError
from meshforge.topology.partitions import partitioned
from meshforge.topology.subjects import command_subject

__all__ = ["addressed", "command_for", "is_pydantic", "to_builtins", "type_name"]


def _pydantic_base() -> type | None:
    """Pydantic's ``BaseModel`` if the program imported Pydantic (a model can exist only then)."""
    module = sys.modules.get("pydantic")
    return cast(type, module.BaseModel) if module is not None else None


def is_pydantic(tp: object) -> bool:
    """Whether ``tp`` is a Pydantic v2 model class."""
    base = _pydantic_base()
    return (
        base is not None
        and isinstance(tp, type)
        and issubclass(tp, base)
        and hasattr(tp, "model_validate_json")
    )


def type_name(tp: type) -> str:
    """How a payload type is named in errors: its qualified name."""
    return getattr(tp, "__qualname__", repr(tp))


def to_builtins(obj: Any) -> Any:
    """A payload as JSON-ready builtins: a typed payload's fields as a dict (Pydantic's
    ``model_dump(mode="json")``), a mapping as a plain dict."""
    if type(obj) is dict:
        return obj
    if is_pydantic(type(obj)):
        return obj.model_dump(mode="json")
    if isinstance(obj, msgspec.Struct) or dataclasses.is_dataclass(obj):
        return msgspec.to_builtins(obj)
    return dict(obj)


def command_for(agent_cls: object, payload: Any) -> tuple[str, str]:
    """``(agent name, command name)`` of the one command of ``agent_cls`` (an agent class
    or an instance) whose declared payload type is ``type(payload)``; ``ConfigError`` if
    none or several are."""
    cls = agent_cls if isinstance(agent_cls, type) else type(agent_cls)
    declared = getattr(cls, "commands", None)
    if not callable(declared):
        raise ConfigError(f"{agent_cls!r} is not an Agent class")
    name = getattr(cls, "name", None)
    if not isinstance(name, str):
        raise ConfigError(f"agent {cls.__qualname__}: set the class attribute 'name'")
    specs = list(declared().values())
    tp = type(payload)
    found = [spec.name for spec in specs if spec.payload is tp]
    if len(found) != 1:
        typed = sorted(f"{s.name} ({type_name(s.payload)})" for s in specs if s.payload is not None)
        how = "no command" if not found else f"{len(found)} commands ({', '.join(sorted(found))})"
        raise ConfigError(
            f"agent {name!r}: {how} takes a {type_name(tp)} payload"
            f" (typed commands: {', '.join(typed) or 'none'})"
        )
    return name, found[0]


def addressed(
    agent_cls: object,
    payload: Any,
    settings: Settings,
    *,
    tenant: str | None = None,
    namespace: str | None = None,
    resource_id: str | None = None,
    **envelope_fields: Any,
) -> tuple[str, Envelope]:
    """The subject and a new envelope for sending typed ``payload`` to ``agent_cls``.

    The command is the one that takes ``type(payload)`` (``command_for``). ``tenant`` and
    ``namespace`` default to the settings' (else ``default``); ``resource_id`` to the
    payload field the command's ``key`` names, so a partitioned deployment orders the
    command with its resource's others. ``envelope_fields`` go to ``Envelope.new``
    (``idempotency_key``, ``source``, ``correlation_id``, ...).
    """
    agent, command = command_for(agent_cls, payload)
    if resource_id is None:
        key = cast(Any, agent_cls).commands()[command].key
        if isinstance(key, str):
            value = getattr(payload, key, None)
            resource_id = None if value is None else str(value)
    tenant = tenant or settings.tenant or "default"
    subject = command_subject(tenant, namespace or settings.namespace or "default", agent, command)
    env = Envelope.new(
        f"{agent}.{command}",
        to_builtins(payload),
        tenant_id=tenant,
        resource_id=resource_id,
        **envelope_fields,
    )
    return partitioned(subject, env, settings), env
