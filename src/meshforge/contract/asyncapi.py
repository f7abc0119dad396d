"""The wire contract of some agents and nodes as an AsyncAPI 3.0.0 document.

docs/CONTRACT.md in machine-readable form, for the teams around a service: a channel per
command subject ``cmd.{tenant}.{namespace}.<agent>.<command>`` (received) and per event
subject ``evt.{tenant}.{namespace}.<agent>.<event>`` (sent), each message's payload the
envelope with its ``payload`` field's schema (the declared type's, or a free object for a
dict payload) and the envelope's NATS headers; the nodes' mailboxes
``control.cmd.{site}.{node}`` with their reply channel; the dead letters ``failed.>``
and the kept originals of truncated ones, with their ``Dlq-*`` headers. The names come
from the code that writes them (``meshforge.envelope``, ``meshforge.transport.headers``,
``meshforge.deadletters``), so the document cannot drift from the wire.

``payload_schemas`` gives only the payloads, as one JSON Schema document whose ``$defs``
hold each message's payload under its message id and the named types they use.

Example::

    doc = asyncapi([OrderAgent, InventoryAgent], [DemoNode()])
    doc["channels"]["cmd.order.create"]["address"]   # 'cmd.{tenant}.{namespace}.order.create'
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from meshforge.contract.declared import Message, agent_messages, node_messages
from meshforge.control.client import H_TTL
from meshforge.control.node import Node
from meshforge.control.reply import REPLY_TYPE, STATUSES
from meshforge.deadletters.originals import H_DLQ_CHUNK, H_DLQ_ORIGINAL_HEADERS
from meshforge.deadletters.route import (
    H_DLQ_CONSUMER,
    H_DLQ_DELIVERIES,
    H_DLQ_ERROR,
    H_DLQ_ORIGINAL,
    H_DLQ_ORIGINAL_SUBJECT,
    H_DLQ_REASON,
    H_DLQ_STREAM,
    H_DLQ_STREAM_SEQ,
    H_DLQ_TIMESTAMP,
    H_DLQ_TRUNCATED,
    REASONS,
)
from meshforge.envelope import (
    H_CAUSATION,
    H_CORRELATION,
    H_IDEMPOTENCY,
    H_MSG_ID,
    H_SCHEMA,
    H_TENANT,
    H_TRACEPARENT,
    SCHEMA_VERSION,
)
from meshforge.errors import ConfigError
from meshforge.runtime.agent import Agent
from meshforge.runtime.payloads import json_schema
from meshforge.transport.headers import PRODUCER_PREFIX

__all__ = [
    "ASYNCAPI_VERSION",
    "DEAD_LETTER_HEADERS",
    "ENVELOPE_HEADERS",
    "ORIGINAL_CHUNK_HEADERS",
    "AgentLike",
    "asyncapi",
    "payload_schemas",
]

ASYNCAPI_VERSION = "3.0.0"
AgentLike = Agent[Any] | type[Agent[Any]]

#: The envelope's headers (CONTRACT.md, "Headers"), as every MeshForge publisher writes them.
ENVELOPE_HEADERS: dict[str, dict[str, Any]] = {
    H_MSG_ID: {"description": "The envelope `id`: the server's duplicate check."},
    H_IDEMPOTENCY: {
        "description": "The envelope `idempotency_key`: duplicates of one request share it."
    },
    H_TENANT: {"description": "The tenant; a command whose tenant disagrees with its subject's is dead-lettered `rejected`."},
    H_SCHEMA: {"description": "The envelope version.", "examples": [SCHEMA_VERSION]},
    H_TRACEPARENT: {
        "description": "W3C trace context: `00-<trace_id>-<span_id>-01`.",
        "pattern": "^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
    },
    H_CAUSATION: {"description": "The id of the message that caused this one, as the body's `causation_id`."},
    H_CORRELATION: {"description": "The id of the first message of the flow, as the body's `correlation_id`."},
}  # fmt: skip

#: The headers the router adds to a dead letter (CONTRACT.md, "Reserved headers").
DEAD_LETTER_HEADERS: dict[str, dict[str, Any]] = {
    H_DLQ_REASON: {"description": "Why it was dead-lettered.", "enum": list(REASONS)},
    H_DLQ_ERROR: {"description": "The error's class and message, one line, at most 1 KiB."},
    H_DLQ_DELIVERIES: {"description": "How many times it was delivered.", "pattern": "^[0-9]+$"},
    H_DLQ_ORIGINAL_SUBJECT: {"description": "The subject it was published on."},
    H_DLQ_STREAM: {"description": "The stream it was stored in."},
    H_DLQ_STREAM_SEQ: {"description": "Its sequence in that stream.", "pattern": "^[0-9]+$"},
    H_DLQ_CONSUMER: {"description": "The durable consumer that gave up on it."},
    H_DLQ_TIMESTAMP: {"description": "When it was dead-lettered (RFC 3339)."},
    H_DLQ_TRUNCATED: {"description": "Only on a dead letter cut to fit the server's limits: `body=<bytes>;kept=<bytes>;headers=<bytes>;dropped=<header names>`."},
    H_DLQ_ORIGINAL: {"description": "With `Dlq-Truncated`: where the whole original is kept, `failed.original.<stream>.<seq>`."},
}  # fmt: skip

#: The headers of each chunk of a truncated dead letter's kept original.
ORIGINAL_CHUNK_HEADERS: dict[str, dict[str, Any]] = {
    H_DLQ_CHUNK: {"description": "`<i>/<n>`: this chunk's place.", "pattern": "^[0-9]+/[0-9]+$"},
    H_DLQ_ORIGINAL_HEADERS: {"description": "How many bytes at the start of the copy are the original's headers, as a JSON object.", "pattern": "^[0-9]+$"},
    H_DLQ_ORIGINAL_SUBJECT: {"description": "The subject the original was published on."},
}  # fmt: skip

_TOKEN_TEXT = "a subject token: 1 to 64 of `A-Z a-z 0-9 _ -`"
_PARAMETERS: dict[str, dict[str, Any]] = {
    "tenant": {"description": f"The tenant ({_TOKEN_TEXT}).", "default": "default"},
    "namespace": {"description": f"The namespace ({_TOKEN_TEXT}).", "default": "default"},
    "site": {"description": f"The node's site ({_TOKEN_TEXT}).", "examples": ["lab1"]},
    "node": {"description": f"The node's name ({_TOKEN_TEXT}).", "examples": ["node7"]},
    "subject": {
        "description": "The subject the message was published on (several tokens); "
        "subscribe to every dead letter with `failed.>`.",
        "examples": ["cmd.default.demo.order.create"],
    },
    "stream": {"description": "The stream the original was stored in.", "examples": ["MESHFORGE_COMMANDS"]},
    "seq": {"description": "Its sequence in that stream.", "examples": ["42"]},
}  # fmt: skip

_NULLABLE_TEXT = {"type": ["string", "null"]}
_TIMESTAMP = {"type": ["string", "null"], "format": "date-time"}


def _envelope(control: bool) -> dict[str, Any]:
    """The envelope's JSON Schema (CONTRACT.md, "Message body"); the control plane's adds
    the scheduling fields."""

    def text(description: str, base: dict[str, Any] = _NULLABLE_TEXT) -> dict[str, Any]:
        return {**base, "description": description}

    properties: dict[str, Any] = {
        "id": text("Unique per message; also sent as `Nats-Msg-Id`."),
        "type": {"type": "string", "minLength": 1, "description": "`<agent>.<command>` or `<agent>.<event>`."},
        "source": text("Who produced it."),
        "tenant_id": text("The tenant."),
        "resource_type": text("What the message is about."),
        "resource_id": text("Per-resource ordering key."),
        "idempotency_key": text("Defaults to `id`; duplicates share it."),
        "causation_id": text("The id of the message that caused this one."),
        "correlation_id": text("The id of the first message of the flow."),
        "trace_id": text("W3C trace id: 32 lowercase hex digits."),
        "span_id": text("W3C span id: 16 lowercase hex digits."),
        "ts": text("Logical timestamp (RFC 3339); filled in if missing.", _TIMESTAMP),
        "schema_version": text("The envelope version."),
        "payload": {"type": "object", "description": "The command's or event's data."},
    }  # fmt: skip
    if control:
        properties |= {
            "not_before_ts": text("Run it not before this time (RFC 3339).", _TIMESTAMP),
            "deadline_ts": text("Not run after this time: replied `expired` (RFC 3339).", _TIMESTAMP),
            "expected_node_epoch": {"type": ["integer", "null"], "description": "Run only at this node epoch, else replied `rejected`."},
            "job": {"type": "string", "description": "The job the command belongs to."},
        }  # fmt: skip
    return {
        "type": "object",
        "description": "A MeshForge envelope; unknown fields are kept and passed on.",
        "required": ["type", "payload"],
        "properties": properties,
    }


def _headers(described: dict[str, dict[str, Any]], **more: Any) -> dict[str, Any]:
    properties = {name: {"type": "string", **about} for name, about in described.items()}
    return {"type": "object", "properties": properties, **more}


_FIXED_SCHEMAS: dict[str, dict[str, Any]] = {
    "Envelope": _envelope(control=False),
    "ControlEnvelope": _envelope(control=True),
    "EnvelopeHeaders": _headers(ENVELOPE_HEADERS),
    "ControlHeaders": _headers(
        {
            **ENVELOPE_HEADERS,
            H_TTL: {"description": "A job's command with a deadline: whole seconds (`30s`) until the server removes it.", "pattern": "^[0-9]+s$"},
        }
    ),
    "ReplyPayload": {
        "type": "object",
        "required": ["status", "result", "error", "node_epoch"],
        "properties": {
            "status": {"type": "string", "enum": list(STATUSES)},
            "result": {"description": "What the handler returned (status `ok`)."},
            "error": {"type": ["string", "null"], "description": "Why it failed (status `error`)."},
            "node_epoch": {"type": ["integer", "null"], "description": "The node's boot counter."},
        },
    },
    "DeadLetterHeaders": _headers(
        DEAD_LETTER_HEADERS,
        required=[H_DLQ_REASON, H_DLQ_ERROR, H_DLQ_ORIGINAL_SUBJECT],
        additionalProperties={"type": "string", "description": f"The producer's own headers; a reserved `Dlq-*` one renamed `{PRODUCER_PREFIX}<name>`."},
    ),
    "OriginalChunkHeaders": _headers(ORIGINAL_CHUNK_HEADERS, required=list(ORIGINAL_CHUNK_HEADERS)),
}  # fmt: skip

_FREE_OBJECT = {"type": "object", "description": "A JSON object (no declared type)."}
_COMPONENT_NAME = re.compile(r"[^\w.\-]")
_LOCAL_REF = "#/$defs/"


class _Schemas:
    """The named types of the payload schemas, each type's own ``$defs`` hoisted under one
    ``prefix`` (``#/components/schemas/`` or ``#/$defs/``); two different types of one
    name, or a type named as one of the ``taken`` schemas, are told apart with a suffix."""

    def __init__(self, prefix: str, taken: Iterable[str] = ()) -> None:
        self.prefix = prefix
        self.named: dict[str, Any] = {}
        # The JSON of each named body; a taken name's matches no body.
        self._bodies: dict[str, str | None] = dict.fromkeys(taken)

    def of(self, tp: type | None) -> dict[str, Any]:
        """The schema of a payload of type ``tp`` (None: a dict), referring to ``named``."""
        if tp is None:
            return dict(_FREE_OBJECT)
        schema = dict(json_schema(tp))
        local: dict[str, Any] = dict(schema.pop("$defs", {}))
        if not (set(schema) == {"$ref"} and str(schema["$ref"]).startswith(_LOCAL_REF)):
            name = str(schema.get("title") or tp.__name__)
            local[name] = schema
            schema = {"$ref": _LOCAL_REF + name}
        renamed = {name: self._place(name, body) for name, body in local.items()}
        for name, body in local.items():
            self.named[renamed[name]] = self._rewrite(body, renamed)
        top: dict[str, Any] = self._rewrite(schema, renamed)
        return top

    def _place(self, name: str, body: Any) -> str:
        key = json.dumps(body, sort_keys=True)
        base = _COMPONENT_NAME.sub("_", name)
        placed, n = base, 1
        while self._bodies.get(placed, key) != key:
            n += 1
            placed = f"{base}_{n}"
        self._bodies[placed] = key
        return placed

    def _rewrite(self, value: Any, renamed: dict[str, str]) -> Any:
        if isinstance(value, dict):
            ref = value.get("$ref")
            out = {k: self._rewrite(v, renamed) for k, v in value.items()}
            if isinstance(ref, str) and ref.startswith(_LOCAL_REF):
                name = ref[len(_LOCAL_REF) :]
                out["$ref"] = self.prefix + renamed.get(name, name)
            return out
        if isinstance(value, list):
            return [self._rewrite(v, renamed) for v in value]
        return value


@dataclass(frozen=True, slots=True)
class _Entry:
    """One message of the contract: where it goes and what it carries."""

    id: str  # the channel's, operation's and message's id: cmd.order.create
    kind: str  # "command", "event" or "node"
    owner: str  # the agent's name or the node class's
    owner_description: str
    message: Message

    @property
    def type(self) -> str:
        """The envelope's ``type``: ``<agent>.<name>``, or a node command's bare name."""
        return self.message.name if self.kind == "node" else f"{self.owner}.{self.message.name}"


def _entries(agents: Sequence[AgentLike], nodes: Sequence[Node]) -> Iterator[_Entry]:
    seen: dict[str, str] = {}
    for agent in agents:
        declared = agent_messages(agent)
        _unique(seen, f"agent {declared.name}", declared.name)
        for command in declared.commands:
            yield _Entry(f"cmd.{declared.name}.{command.name}", "command", declared.name,
                         declared.description, command)  # fmt: skip
        for event in declared.events:
            yield _Entry(f"evt.{declared.name}.{event.name}", "event", declared.name,
                         declared.description, event)  # fmt: skip
    for node in nodes:
        found = node_messages(node)
        _unique(seen, f"node {found.name}", f"node:{found.name}")
        for command in found.commands:
            yield _Entry(f"control.{found.name}.{command.name}", "node", found.name,
                         found.description, command)  # fmt: skip


def _unique(seen: dict[str, str], what: str, key: str) -> None:
    if key in seen:
        raise ConfigError(f"{what} is given twice: each agent and node class once")
    seen[key] = what


def payload_schemas(agents: Sequence[AgentLike], nodes: Sequence[Node] = ()) -> dict[str, Any]:
    """The payloads alone: a JSON Schema document whose ``$defs`` hold each message's
    payload under its id (``cmd.order.create``, ``evt.order.created``,
    ``control.DemoNode.echo``, ``control.reply``) and the named types they use."""
    schemas = _Schemas(_LOCAL_REF)
    messages: dict[str, Any] = {}
    for entry in _entries(agents, nodes):
        messages[entry.id] = _described(schemas.of(entry.message.payload), entry.message)
    if nodes:
        messages[REPLY_TYPE] = _FIXED_SCHEMAS["ReplyPayload"]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": _title(agents, nodes) + ": payloads",
        "$defs": {**schemas.named, **messages},
    }


def _described(schema: dict[str, Any], message: Message) -> dict[str, Any]:
    return {**schema, "description": message.description} if message.description else schema


def _title(agents: Sequence[AgentLike], nodes: Sequence[Node]) -> str:
    names = [a.name for a in agents] + [type(n).__name__ for n in nodes]
    return "MeshForge: " + ", ".join(names)


def _ref(*path: str) -> dict[str, str]:
    return {"$ref": "#/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in path)}


def _params(*names: str) -> dict[str, Any]:
    return {name: _ref("components", "parameters", name) for name in names}


def asyncapi(
    agents: Sequence[AgentLike],
    nodes: Sequence[Node] = (),
    *,
    title: str | None = None,
    version: str = SCHEMA_VERSION,
    tenant: str | None = None,
) -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document of ``agents`` (classes or instances) and ``nodes``.

    ``version`` is the API's (default: the envelope version); ``tenant`` narrows the
    ``tenant`` parameter to one value (a console bound to a tenant).
    """
    schemas = _Schemas("#/components/schemas/", taken=_FIXED_SCHEMAS)
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    parameters = {name: dict(about) for name, about in _PARAMETERS.items()}
    if tenant is not None:
        parameters["tenant"] |= {"enum": [tenant], "default": tenant}
    node_channels: dict[str, dict[str, Any]] = {}
    tags: dict[str, dict[str, str]] = {}
    for entry in _entries(agents, nodes):
        tags.setdefault(entry.owner, _tag(entry))
        payload = schemas.of(entry.message.payload)
        messages[entry.id] = _message(entry, payload)
        message_ref = {entry.id: _ref("components", "messages", entry.id)}
        if entry.kind == "node":
            channel_id = f"control.cmd.{entry.owner}"
            channel = node_channels.get(channel_id)
            if channel is None:
                channel = node_channels[channel_id] = {
                    "address": "control.cmd.{site}.{node}",
                    "title": f"Mailbox of a {entry.owner} node",
                    "description": f"Commands to a node running `{entry.owner}`, each run "
                    "once and answered once on `control.reply.{site}.{node}`.",
                    "parameters": _params("site", "node"),
                    "messages": {},
                }
                channels[channel_id] = channel
            channel["messages"] |= message_ref
            operations[entry.id] = _operation(entry, "receive", channel_id) | {
                "reply": {
                    "channel": _ref("channels", "control.reply"),
                    "messages": [_ref("channels", "control.reply", "messages", REPLY_TYPE)],
                }
            }
            continue
        prefix, verb = ("cmd", "receive") if entry.kind == "command" else ("evt", "send")
        channels[entry.id] = {
            "address": f"{prefix}.{{tenant}}.{{namespace}}.{entry.owner}.{entry.message.name}",
            "title": entry.type,
            "description": _channel_text(entry),
            "parameters": _params("tenant", "namespace"),
            "messages": message_ref,
        }
        operations[entry.id] = _operation(entry, verb, entry.id)
    if nodes:
        channels["control.reply"] = {
            "address": "control.reply.{site}.{node}",
            "title": "A node's replies",
            "description": "Exactly one reply envelope per command, `causation_id` = the command's `id`.",
            "parameters": _params("site", "node"),
            "messages": {REPLY_TYPE: _ref("components", "messages", REPLY_TYPE)},
        }  # fmt: skip
        messages[REPLY_TYPE] = _reply_message()
    channels |= _dead_letter_channels()
    operations |= _dead_letter_operations()
    messages |= _dead_letter_messages()
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": title or _title(agents, nodes),
            "version": version,
            "description": "The wire contract of MeshForge agents and nodes on NATS JetStream "
            "(docs/CONTRACT.md): JSON envelopes, UTF-8.",
            "tags": list(tags.values()),
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {
            "schemas": {**_FIXED_SCHEMAS, **schemas.named},
            "parameters": parameters,
            "messages": messages,
        },
    }


def _tag(entry: _Entry) -> dict[str, str]:
    """The tag of an agent or node class: its operations carry its name."""
    what = "node class" if entry.kind == "node" else "agent"
    tag = {"name": entry.owner, "description": f"The {what} `{entry.owner}`."}
    if entry.owner_description:
        tag["description"] += "\n\n" + entry.owner_description
    return tag


def _channel_text(entry: _Entry) -> str:
    if entry.kind == "command":
        return (
            f"Command `{entry.type}` to the agent `{entry.owner}`: each is run once, in the "
            "order of its `resource_id`. With partitions on, a sixth token is the partition."
        )
    return f"Event `{entry.type}` of the agent `{entry.owner}`, kept in `MESHFORGE_EVENTS`."


def _message(entry: _Entry, payload: dict[str, Any]) -> dict[str, Any]:
    control = entry.kind == "node"
    envelope = "ControlEnvelope" if control else "Envelope"
    body = {
        "type": "object",
        "properties": {"type": {"const": entry.type}, "payload": payload},
    }
    message: dict[str, Any] = {
        "name": entry.type,
        "title": entry.type,
        "summary": f"{entry.kind} {entry.type}" if not control else f"{entry.owner} command {entry.type}",
        "headers": _ref("components", "schemas", "ControlHeaders" if control else "EnvelopeHeaders"),
        "payload": {"allOf": [_ref("components", "schemas", envelope), body]},
    }  # fmt: skip
    if entry.message.description:
        message["description"] = entry.message.description
    return message


def _operation(entry: _Entry, action: str, channel_id: str) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "action": action,
        "channel": _ref("channels", channel_id),
        "messages": [_ref("channels", channel_id, "messages", entry.id)],
        "summary": f"{'Handles' if action == 'receive' else 'Emits'} {entry.type}",
        "tags": [{"name": entry.owner}],
    }
    if entry.message.description:
        operation["description"] = entry.message.description
    return operation


def _reply_message() -> dict[str, Any]:
    body = {
        "type": "object",
        "properties": {
            "type": {"const": REPLY_TYPE},
            "payload": _ref("components", "schemas", "ReplyPayload"),
        },
    }
    return {
        "name": REPLY_TYPE,
        "title": "A node's reply",
        "headers": _ref("components", "schemas", "EnvelopeHeaders"),
        "payload": {"allOf": [_ref("components", "schemas", "Envelope"), body]},
        "correlationId": {
            "description": "The command's id.",
            "location": "$message.payload#/causation_id",
        },
    }


def _dead_letter_channels() -> dict[str, Any]:
    return {
        "failed": {
            "address": "failed.{subject}",
            "title": "Dead letters",
            "description": "What could not be handled, kept in `MESHFORGE_FAILED` until "
            "inspected, re-driven or purged: the original body and the producer's headers, "
            "plus the `Dlq-*` headers. Subscribe with `failed.>`.",
            "parameters": _params("subject"),
            "messages": {"deadLetter": _ref("components", "messages", "deadLetter")},
        },
        "failed.original": {
            "address": "failed.original.{stream}.{seq}",
            "title": "Kept originals",
            "description": "The whole original of a truncated dead letter (`Dlq-Original`), "
            "in chunks: its headers as a JSON object, then its body.",
            "parameters": _params("stream", "seq"),
            "messages": {"originalChunk": _ref("components", "messages", "originalChunk")},
        },
    }


def _dead_letter_operations() -> dict[str, Any]:
    return {
        channel: {
            "action": "send",
            "channel": _ref("channels", channel),
            "messages": [_ref("channels", channel, "messages", message)],
            "summary": summary,
        }
        for channel, message, summary in (
            ("failed", "deadLetter", "Dead-letters what cannot be handled"),
            ("failed.original", "originalChunk", "Keeps the original of a truncated dead letter"),
        )
    }


def _dead_letter_messages() -> dict[str, Any]:
    return {
        "deadLetter": {
            "name": "deadLetter",
            "title": "A dead letter",
            "contentType": "application/octet-stream",
            "headers": _ref("components", "schemas", "DeadLetterHeaders"),
            "payload": {"description": "The original body, as it was sent (cut to fit with `Dlq-Truncated`)."},
        },
        "originalChunk": {
            "name": "originalChunk",
            "title": "A chunk of a kept original",
            "contentType": "application/octet-stream",
            "headers": _ref("components", "schemas", "OriginalChunkHeaders"),
            "payload": {"description": "Bytes of the original: its headers (JSON), then its body."},
        },
    }  # fmt: skip
