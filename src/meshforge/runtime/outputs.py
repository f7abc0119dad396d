"""From a handler's ``Event``/``Send`` list to the messages and log entries the engine stores.

Each output becomes a child envelope of the command (``Envelope.child``: id derived from
the command's id and the output's position, same trace, a child span, ``causation_id``
= the command's id), so computing the outputs twice gives byte-identical messages.
Events are also folded into the state with ``Agent.apply`` and kept for the event log.

Example::

    state, outputs, events = build_outputs(agent, cmd, "o-1", "cmd.default.demo.order.create",
                                           [Event("created", {"order_id": "o-1"})], state)
    outputs[0].subject    # 'evt.default.demo.order.created'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec

from meshforge.envelope import Envelope, Outbound, now_ts
from meshforge.errors import ConfigError, InvalidPayload, Unrecoverable
from meshforge.runtime import payloads
from meshforge.runtime.agent import Agent, Event, Output, Send
from meshforge.store.base import NewEvent, StoredOutput
from meshforge.topology.partitions import partition_key, partition_subject
from meshforge.topology.scope import Scope, command_scope
from meshforge.topology.subjects import command_subject, event_subject

__all__ = [
    "build_outputs",
    "event_name",
    "normalize_payload",
    "scope_of",
    "stored_event",
]

S = TypeVar("S")
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(dict[str, Any])
_ANY = msgspec.json.Decoder()


def normalize_payload(payload: Mapping[str, Any] | Any) -> tuple[bytes, dict[str, Any]]:
    """The payload (a dict or a typed payload) as JSON bytes and as the plain dict those
    bytes decode to.

    ``apply`` always sees the decoded form, live and in replay alike, so the two agree.
    """
    data = _ENCODER.encode(payload) if type(payload) is dict else payloads.encode(payload)
    return data, _DECODER.decode(data)


def stored_event(agent: Agent[Any], type_: str, data: bytes) -> Event:
    """A stored event as ``apply`` sees it: its payload decoded into its type if the agent
    names one in ``Agent.events`` (else a dict; bytes that are no JSON object, an empty
    one). An event stored before its type gained a field (with a default) decodes into
    the newer type; one that does not fit it is a ``ConfigError`` naming the event."""
    name = event_name(agent.name, type_)
    typed = agent.event_decoders.get(name) if agent.event_decoders else None
    if typed is not None:
        try:
            return Event(name, typed.decode(data))
        except InvalidPayload as exc:
            raise ConfigError(
                f"stored event {type_!r} does not fit the agent's events[{name!r}] ({exc}); a"
                " payload type may only gain fields with defaults (docs/AGENTS.md)"
            ) from None
    try:
        payload = _ANY.decode(data)
    except msgspec.DecodeError:
        payload = None
    return Event(name, payload if isinstance(payload, dict) else {})


def scope_of(subject: str, env: Envelope) -> tuple[str, str]:
    """``(tenant, namespace)`` of a command from its ``cmd.<tenant>.<ns>.<agent>.<cmd>`` subject."""
    scope = command_scope(subject, env.tenant_id)
    return scope.tenant, scope.namespace


def event_name(agent: str, type_: str) -> str:
    """The verb of an event type ``<agent>.<verb>`` (the type itself if it has no prefix)."""
    prefix = agent + "."
    return type_[len(prefix) :] if type_.startswith(prefix) else type_


def build_outputs(
    agent: Agent[S],
    cmd: Envelope,
    resource: str,
    subject: str,
    outputs: Sequence[Output],
    state: S,
    partitions: int = 0,
    scope: Scope | None = None,
) -> tuple[S, list[StoredOutput], list[NewEvent]]:
    """The new state, the messages to store and publish, and the events to append.

    Every output carries the subject's tenant (a ``Send`` may name another on purpose).
    With ``partitions`` > 0 (the deployment's setting) a ``Send`` goes to its partition,
    ``cmd.<t>.<ns>.<agent>.<command>.<p>``, by its resource id (else its own id).
    ``scope`` is the subject's, when the caller has it already.
    """
    tenant, namespace = scope or scope_of(subject, cmd)
    stored: list[StoredOutput] = []
    events: list[NewEvent] = []
    ts = cmd.ts or now_ts()  # the children's logical time: one for all of them
    typed_events = agent.event_decoders
    for position, out in enumerate(outputs):
        data, payload = normalize_payload(out.payload)
        if isinstance(out, Event):
            out_subject = event_subject(tenant, namespace, agent.name, out.name)
            type_ = f"{agent.name}.{out.name}"
            msg_id, body, headers = cmd.child_message(
                out_subject, type_, payload, position, source=agent.name,
                resource_type=agent.name, resource_id=resource, tenant_id=tenant, ts=ts,
            )  # fmt: skip
            events.append(NewEvent(msg_id, type_, resource, cmd.id, cmd.key, data, ts))
            typed = typed_events.get(out.name) if typed_events else None
            if typed is not None:  # apply sees what replay will decode from ``data``
                try:
                    payload = typed.decode(data)
                except InvalidPayload as exc:
                    raise Unrecoverable(f"event {type_!r}: {exc}") from None
            # After the message is built: what apply does to the payload stays out of it.
            state = agent.apply(state, Event(out.name, payload))
        elif isinstance(out, Send):
            out_subject = command_subject(
                out.tenant or tenant, out.namespace or namespace, out.agent, out.command
            )
            child = cmd.child(
                f"{out.agent}.{out.command}", payload, position,
                source=agent.name, resource_type=out.agent, resource_id=out.resource_id,
                tenant_id=out.tenant or tenant, ts=ts,
            )  # fmt: skip
            out_subject = partition_subject(out_subject, partition_key(child), partitions)
            sent = Outbound.of(out_subject, child)
            msg_id, body, headers = sent.msg_id, sent.data, sent.headers
        else:  # pragma: no cover - Agent.handle already checked the types
            raise TypeError(f"not an output: {out!r}")
        stored.append(StoredOutput(position, out_subject, msg_id, body, headers))
    return state, stored, events
