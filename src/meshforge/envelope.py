"""The envelope: MeshForge's message body, its JSON codec, headers and trace context.

Example::

    env = Envelope.new("order.create", {"sku": "A-1", "qty": 2}, source="gateway")
    data, headers = env.encode(), env.headers()        # body bytes, NATS headers
    same = decode(data, headers)                       # raises only MalformedMessage
    event = same.child("order.created", {"order_id": "o-1"}, position=0)
    assert event.causation_id == env.id
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any, Self

import msgspec

from meshforge.errors import MalformedMessage

__all__ = [
    "H_CAUSATION",
    "H_CORRELATION",
    "H_IDEMPOTENCY",
    "H_MSG_ID",
    "H_SCHEMA",
    "H_TENANT",
    "H_TRACEPARENT",
    "SCHEMA_VERSION",
    "Envelope",
    "Outbound",
    "decode",
    "derive_id",
    "format_traceparent",
    "now_ts",
    "parse_traceparent",
]

SCHEMA_VERSION = "1.0"
H_MSG_ID = "Nats-Msg-Id"
H_IDEMPOTENCY = "Idempotency-Key"
H_TENANT = "Tenant-Id"
H_SCHEMA = "Schema-Version"
H_TRACEPARENT = "traceparent"
H_CAUSATION = "Causation-Id"
H_CORRELATION = "Correlation-Id"

# Ids derived from a cause are UUIDv5 in this namespace: the same cause and position
# always give the same id, so a re-published output is the same message.
_ID_NAMESPACE = uuid.UUID("6d657368-666f-7267-6500-000000000001").bytes
_ID_SHA1 = hashlib.sha1(_ID_NAMESPACE)
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
_NO_TRACE, _NO_SPAN = "0" * 32, "0" * 16
_JSON_ENCODER = msgspec.json.Encoder()
_JSON_DECODER = msgspec.json.Decoder()


def now_ts() -> str:
    """The current time as RFC 3339 UTC with microseconds, e.g. ``2026-11-25T21:00:00.000000Z``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def derive_id(cause_id: str, position: int) -> str:
    """Deterministic id of the ``position``-th output caused by message ``cause_id``."""
    # ``uuid5_str(_ID_NAMESPACE, ...)`` from a copy of the namespace's hash: a copy costs
    # less than a new hash object, and the namespace is hashed once.
    h = _ID_SHA1.copy()
    h.update(f"{cause_id}/{position}".encode())
    return _uuid5_text(h.hexdigest())


def uuid5_str(namespace: bytes, name: str) -> str:
    """``str(uuid.uuid5(UUID(bytes=namespace), name))``, without building a ``UUID`` (on
    the hot path: an id for every output)."""
    return _uuid5_text(hashlib.sha1(namespace + name.encode()).hexdigest())


def _uuid5_text(h: str) -> str:
    """A UUID's text from the hex SHA-1 of its namespace and name (RFC 4122 version 5: the
    version nibble becomes 5, the variant bits of byte 8 become 10)."""
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}"


# The first hex digit of byte 8 with its top two bits set to the RFC 4122 variant, 10.
_VARIANT = {digit: "89ab"[int(digit, 16) & 3] for digit in "0123456789abcdef"}


def _hex(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def format_traceparent(trace_id: str, span_id: str) -> str:
    """W3C ``traceparent`` value ``00-<trace_id>-<span_id>-01``."""
    return f"00-{trace_id}-{span_id}-01"


def parse_traceparent(value: str | None) -> tuple[str, str] | None:
    """``(trace_id, span_id)`` from a W3C ``traceparent``, or None if it is not valid."""
    if not value:
        return None
    m = _TRACEPARENT.fullmatch(value.strip().lower())
    if m is None:
        return None
    trace_id, span_id = m.groups()
    if trace_id == _NO_TRACE or span_id == _NO_SPAN:
        return None
    return trace_id, span_id


_STR_FIELDS = (
    "id", "type", "source", "tenant_id", "resource_type", "resource_id", "idempotency_key",
    "causation_id", "correlation_id", "trace_id", "span_id", "ts", "schema_version",
    "not_before_ts", "deadline_ts",
)  # fmt: skip
_OPTIONAL_OUT = ("not_before_ts", "deadline_ts", "expected_node_epoch")
_LOCAL_FIELDS = ("extra", "body_tenant_id")


@dataclass(slots=True)
class Envelope:
    """One command or event. ``key`` is the idempotency key (``idempotency_key`` or ``id``)."""

    id: str
    type: str
    payload: dict[str, Any]
    source: str = "meshforge"
    tenant_id: str = "default"
    resource_type: str | None = None
    resource_id: str | None = None
    idempotency_key: str | None = None
    causation_id: str | None = None
    correlation_id: str | None = None
    trace_id: str | None = None
    span_id: str | None = None
    ts: str = ""
    schema_version: str = SCHEMA_VERSION
    not_before_ts: str | None = None
    deadline_ts: str | None = None
    expected_node_epoch: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # What the received body said about the tenant, before the header or subject won;
    # never encoded: admission compares it with the subject.
    body_tenant_id: str | None = field(default=None, repr=False, compare=False)

    @classmethod
    def new(cls, type: str, payload: Mapping[str, Any] | None = None, **fields_: Any) -> Self:
        """A fresh envelope: new id, ``ts`` now, trace ids started, correlation = own id."""
        env_id = fields_.pop("id", None) or str(uuid.uuid4())
        fields_.setdefault("ts", now_ts())
        fields_.setdefault("trace_id", uuid.uuid4().hex)
        fields_.setdefault("span_id", _hex(env_id, 16))
        fields_.setdefault("correlation_id", env_id)
        fields_.setdefault("idempotency_key", env_id)
        return cls(id=env_id, type=type, payload=dict(payload or {}), **fields_)

    @property
    def key(self) -> str:
        """The idempotency key: duplicates of one request share it."""
        return self.idempotency_key or self.id

    def child(
        self,
        type: str,
        payload: Mapping[str, Any],
        position: int,
        **fields_: Any,
    ) -> Envelope:
        """The ``position``-th output caused by this message: deterministic id, same trace,
        a child span, ``causation_id`` = this id, and this message's logical ``ts``."""
        base = self._child_base(position)
        child_id = base["idempotency_key"]
        base.update(fields_)
        return Envelope(id=child_id, type=type, payload=dict(payload), **base)

    def with_(self, **changes: Any) -> Envelope:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def addressed_to(self, subject: str) -> Envelope:
        """This envelope as sent on ``subject``: a tenant left at ``default`` takes the tenant
        a ``cmd.``/``evt.`` subject names, since the subject is the tenant's authority."""
        if self.tenant_id != "default" or not subject.startswith(("cmd.", "evt.")):
            return self
        tenant = subject.split(".", 2)[1]
        return self.with_(tenant_id=tenant) if tenant and tenant != "default" else self

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: unknown fields first (known ones win), optional control fields when set."""
        out: dict[str, Any] = dict(self.extra)
        for name in _FIELD_NAMES:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_OUT:
                continue
            out[name] = value
        return out

    def encode(self) -> bytes:
        """UTF-8 JSON bytes of the envelope."""
        return _JSON_ENCODER.encode(self.to_dict())

    def headers(self) -> dict[str, str]:
        """NATS headers for this envelope (CONTRACT.md, "Headers")."""
        return _headers(
            self.id, self.key, self.tenant_id, self.schema_version, self.trace_id,
            self.span_id, self.causation_id, self.correlation_id,
        )  # fmt: skip

    def child_message(
        self, subject: str, type: str, payload: Mapping[str, Any], position: int, **fields_: Any
    ) -> tuple[str, bytes, dict[str, str]]:
        """``msg_id``, ``data`` and ``headers`` of ``Outbound.of(subject, self.child(type,
        payload, position, **fields_))``, built without the child envelope or the message
        (on the hot path: every output of every command)."""
        base = self._child_base(position)
        base.update(fields_)
        if not _CHILD_FIELDS.issuperset(fields_) or (
            base["tenant_id"] == "default"
            and subject.startswith(("cmd.", "evt."))
            and not subject.startswith(
                ("cmd.default.", "evt.default.")
            )  # addressed_to may change it
        ):
            sent = Outbound.of(subject, self.child(type, payload, position, **fields_))
            return sent.msg_id, sent.data, sent.headers
        child_id = base["idempotency_key"]
        body = {"id": child_id, "type": type, "payload": dict(payload), **base}
        headers = _headers(
            child_id, child_id, base["tenant_id"], base["schema_version"], base["trace_id"],
            base["span_id"], base["causation_id"], base["correlation_id"],
        )  # fmt: skip
        return child_id, _JSON_ENCODER.encode(body), headers

    def _child_base(self, position: int) -> dict[str, Any]:
        """The fields of the ``position``-th child after ``payload``, in field order; its id
        is its ``idempotency_key``."""
        child_id = derive_id(self.id, position)
        return {
            "source": self.source,
            "tenant_id": self.tenant_id,
            "resource_type": self.resource_type,
            "resource_id": self.resource_id,
            "idempotency_key": child_id,
            "causation_id": self.id,
            "correlation_id": self.correlation_id or self.id,
            "trace_id": self.trace_id or _hex(self.id, 32),
            "span_id": _hex(child_id, 16),
            "ts": self.ts or now_ts(),
            "schema_version": self.schema_version,
        }


def _headers(
    msg_id: str, key: str, tenant: str, schema: str, trace_id: str | None, span_id: str | None,
    causation: str | None, correlation: str | None,
) -> dict[str, str]:  # fmt: skip
    h = {H_MSG_ID: msg_id, H_IDEMPOTENCY: key, H_TENANT: tenant, H_SCHEMA: schema}
    if trace_id and span_id:
        tp = format_traceparent(trace_id, span_id)
        if (_plain_hex(trace_id, 32) and _plain_hex(span_id, 16)) or parse_traceparent(tp):
            h[H_TRACEPARENT] = tp
    if causation:
        h[H_CAUSATION] = causation
    if correlation:
        h[H_CORRELATION] = correlation
    return h


def _plain_hex(value: str, length: int) -> bool:
    """Lowercase hex of ``length`` digits, not all zero: a valid trace or span id as is
    (``parse_traceparent`` decides the other forms)."""
    return len(value) == length and _LOWER_HEX.issuperset(value) and value.strip("0") != ""


@dataclass(slots=True, frozen=True)
class Outbound:
    """A message ready to publish: subject, body, headers and its ``Nats-Msg-Id``."""

    subject: str
    data: bytes
    headers: dict[str, str]
    msg_id: str

    @classmethod
    def of(cls, subject: str, env: Envelope) -> Outbound:
        env = env.addressed_to(subject)
        return cls(subject=subject, data=env.encode(), headers=env.headers(), msg_id=env.id)


# Computed once: ``fields()`` per message was a measurable part of the hot path.
_FIELD_NAMES = tuple(f.name for f in fields(Envelope) if f.name not in _LOCAL_FIELDS)
_KNOWN = frozenset(_FIELD_NAMES)
# What ``child_message`` lets a caller set without building the child envelope (the
# others it leaves to ``child``).
_CHILD_FIELDS = frozenset(("source", "tenant_id", "resource_type", "resource_id", "trace_id", "ts"))
_LOWER_HEX = frozenset("0123456789abcdef")
_STR_OR_NONE = frozenset({str, type(None)})


def _valid_ts(value: str) -> bool:
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def undecodable(data: bytes | bytearray | memoryview, exc: BaseException) -> str:
    """Why a body is not JSON, in one line: ``not UTF-8 at byte N`` or ``not JSON: ...``."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"body is not UTF-8 at byte {bad.start} (0x{bytes(data)[bad.start]:02x})"
    if not text.strip():
        return "body is not JSON: it is empty"
    return f"body is not JSON: {exc} (starts {text[:40]!r})"


def decode(
    data: bytes | bytearray | memoryview,
    headers: Mapping[str, str] | None = None,
    *,
    default_ts: str | Callable[[], str] | None = None,
) -> Envelope:
    """Parse an envelope; headers win over the body for the same fact.

    The body's own ``tenant_id`` is kept in ``body_tenant_id`` so admission can compare
    header, body and subject (the subject decides; see ``meshforge.topology.scope``).

    A missing ``id`` becomes the ``Nats-Msg-Id`` header or an id derived from the bytes
    (so redeliveries agree); a missing ``ts`` becomes ``default_ts`` (e.g. the stream's
    stored time; a function is called only then) or now. Raises :class:`MalformedMessage`
    and nothing else.
    """
    try:
        obj = _JSON_DECODER.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, ValueError, TypeError, RecursionError) as exc:
        raise MalformedMessage(undecodable(data, exc)) from None
    if not isinstance(obj, dict):
        raise MalformedMessage(f"body is a JSON {type(obj).__name__}, expected an object")
    h = headers or {}
    if "type" not in obj:
        raise MalformedMessage("envelope lacks 'type'")
    if "payload" not in obj:
        raise MalformedMessage("envelope lacks 'payload'")
    if not isinstance(obj["payload"], dict):
        raise MalformedMessage(
            f"'payload' is a JSON {type(obj['payload']).__name__}, expected an object"
        )
    get, hget = obj.get, h.get
    if not _STR_OR_NONE.issuperset(map(type, map(get, _STR_FIELDS))):  # one C pass
        for name in _STR_FIELDS:
            value = get(name)
            if value is not None and not isinstance(value, str):
                raise MalformedMessage(f"'{name}' must be a string, got {type(value).__name__}")
    if not obj["type"]:
        raise MalformedMessage("'type' is empty")
    epoch = get("expected_node_epoch")
    if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)):
        raise MalformedMessage(f"'expected_node_epoch' must be an integer, got {epoch!r}")
    for name in ("ts", "not_before_ts", "deadline_ts"):
        value = get(name)
        if value and not _valid_ts(value):
            raise MalformedMessage(f"'{name}' is not an RFC 3339 timestamp: {value[:64]!r}")

    extra = {} if _KNOWN.issuperset(obj) else {k: v for k, v in obj.items() if k not in _KNOWN}
    env_id = get("id") or hget(H_MSG_ID) or uuid5_str(_ID_NAMESPACE, bytes(data).hex())
    trace = parse_traceparent(hget(H_TRACEPARENT))
    return Envelope(
        id=env_id,
        type=obj["type"],
        payload=obj["payload"],
        source=get("source") or "",
        tenant_id=hget(H_TENANT) or get("tenant_id") or "default",
        resource_type=get("resource_type"),
        resource_id=get("resource_id"),
        idempotency_key=hget(H_IDEMPOTENCY) or get("idempotency_key") or env_id,
        causation_id=hget(H_CAUSATION) or get("causation_id"),
        correlation_id=hget(H_CORRELATION) or get("correlation_id"),
        trace_id=trace[0] if trace else get("trace_id"),
        span_id=trace[1] if trace else get("span_id"),
        ts=get("ts") or (default_ts() if callable(default_ts) else default_ts) or now_ts(),
        schema_version=hget(H_SCHEMA) or get("schema_version") or SCHEMA_VERSION,
        not_before_ts=get("not_before_ts"),
        deadline_ts=get("deadline_ts"),
        expected_node_epoch=epoch,
        extra=extra,
        body_tenant_id=get("tenant_id") or None,
    )
