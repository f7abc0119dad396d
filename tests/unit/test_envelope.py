from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshforge.envelope import (
    H_IDEMPOTENCY,
    H_MSG_ID,
    H_TENANT,
    H_TRACEPARENT,
    Envelope,
    Outbound,
    decode,
    derive_id,
    format_traceparent,
    parse_traceparent,
)
from meshforge.errors import MalformedMessage

json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
payloads = st.dictionaries(st.text(max_size=10), json_values, max_size=5)
tokens = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=30
)


@given(payload=payloads, type_=tokens, source=tokens, resource=st.none() | tokens)
def test_round_trip(payload: dict[str, Any], type_: str, source: str, resource: str | None) -> None:
    env = Envelope.new(type_, payload, source=source, resource_id=resource)
    back = decode(env.encode(), env.headers())
    assert back == env


@given(
    extra=st.dictionaries(
        st.text(min_size=1, max_size=8).filter(lambda k: k not in Envelope.__dataclass_fields__),
        json_values,
        max_size=4,
    )
)
def test_unknown_fields_are_kept(extra: dict[str, Any]) -> None:
    env = Envelope.new("a.b", {"x": 1})
    body = {**json.loads(env.encode()), **extra}
    back = decode(json.dumps(body).encode())
    assert back.extra == extra
    assert json.loads(back.encode()) == body


@settings(max_examples=500)
@given(data=st.binary(max_size=200))
def test_any_bytes_decode_or_raise_malformed(data: bytes) -> None:
    try:
        decode(data)
    except MalformedMessage as exc:
        assert "\n" not in str(exc)


@settings(max_examples=300)
@given(
    obj=st.dictionaries(
        st.sampled_from(
            ["id", "type", "payload", "ts", "tenant_id", "expected_node_epoch", "deadline_ts", "x"]
        ),
        json_values,
        max_size=6,
    )
)
def test_any_json_object_decodes_or_raises_malformed(obj: dict[str, Any]) -> None:
    try:
        env = decode(json.dumps(obj).encode())
    except MalformedMessage:
        return
    assert isinstance(env.payload, dict) and env.type


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"not json", r"^body is not JSON: .*invalid character \(byte 4\) \(starts 'not json'\)$"),
        (b"", "^body is not JSON: it is empty$"),
        (b'{"a": "\xff"}', r"^body is not UTF-8 at byte 7 \(0xff\)$"),
        (b"[1, 2]", "expected an object"),
        (b'{"payload": {}}', "lacks 'type'"),
        (b'{"type": "a.b"}', "lacks 'payload'"),
        (b'{"type": "a.b", "payload": 3}', "'payload' is a JSON int"),
        (b'{"type": 5, "payload": {}}', "'type' must be a string"),
        (b'{"type": "a.b", "payload": {}, "ts": "yesterday"}', "RFC 3339"),
        (b'{"type": "a.b", "payload": {}, "expected_node_epoch": "7"}', "expected_node_epoch"),
        (b"\xff\xfe", "UTF-8"),
    ],
)
def test_malformed_says_why(body: bytes, why: str) -> None:
    with pytest.raises(MalformedMessage, match=why):
        decode(body)


def test_headers_win_over_body() -> None:
    env = Envelope.new("order.create", {}, tenant_id="body-tenant")
    headers = env.headers() | {
        H_TENANT: "hdr-tenant",
        H_IDEMPOTENCY: "k-1",
        H_TRACEPARENT: format_traceparent("a" * 32, "b" * 16),
    }
    back = decode(env.encode(), headers)
    assert (back.tenant_id, back.key, back.trace_id, back.span_id) == (
        "hdr-tenant",
        "k-1",
        "a" * 32,
        "b" * 16,
    )


def test_missing_fields_are_filled_deterministically() -> None:
    body = b'{"type": "order.create", "payload": {"sku": "A"}}'
    a = decode(body, default_ts="2026-01-01T00:00:00Z")
    b = decode(body, default_ts="2026-01-01T00:00:00Z")
    assert a.id == b.id and a.ts == "2026-01-01T00:00:00Z" and a.key == a.id
    assert decode(body, {H_MSG_ID: "m-1"}).id == "m-1"


def test_child_is_deterministic_and_linked() -> None:
    cmd = Envelope.new("order.create", {"sku": "A"}, resource_id="r1")
    e1 = cmd.child("order.created", {"order_id": "o"}, 0)
    e2 = cmd.child("order.created", {"order_id": "o"}, 0)
    assert e1 == e2
    assert e1.id == derive_id(cmd.id, 0) != derive_id(cmd.id, 1)
    assert e1.causation_id == cmd.id and e1.correlation_id == cmd.id
    assert e1.trace_id == cmd.trace_id and e1.span_id != cmd.span_id
    assert e1.ts == cmd.ts
    out = Outbound.of("evt.default.demo.order.created", e1)
    assert out.msg_id == e1.id and out.headers[H_MSG_ID] == e1.id


def test_traceparent() -> None:
    assert parse_traceparent(format_traceparent("1" * 32, "2" * 16)) == ("1" * 32, "2" * 16)
    assert parse_traceparent("garbage") is None
    assert parse_traceparent("00-" + "0" * 32 + "-" + "2" * 16 + "-01") is None


@given(st.text(max_size=200), st.integers(min_value=0, max_value=10**6))
def test_derived_ids_are_the_standard_uuid5(cause: str, position: int) -> None:
    # Ids are part of the wire contract: the fast form must be uuid.uuid5 exactly.
    namespace = uuid.UUID("6d657368-666f-7267-6500-000000000001")
    assert derive_id(cause, position) == str(uuid.uuid5(namespace, f"{cause}/{position}"))


hexes = st.text(alphabet="0123456789abcdefABCDEF -", max_size=34)
ids = st.none() | st.sampled_from(["", "0" * 32, "0" * 16, "a" * 32, "b" * 16]) | hexes


@given(trace=ids, span=ids, causation=st.none() | tokens, correlation=st.none() | tokens)
def test_headers_match_their_definition(
    trace: str | None, span: str | None, causation: str | None, correlation: str | None
) -> None:
    env = Envelope.new("order.create", {}, trace_id=trace, span_id=span, causation_id=causation,
                       correlation_id=correlation)  # fmt: skip
    expected = {
        H_MSG_ID: env.id,
        H_IDEMPOTENCY: env.key,
        H_TENANT: env.tenant_id,
        "Schema-Version": "1.0",
    }
    if trace and span and parse_traceparent(format_traceparent(trace, span)):
        expected[H_TRACEPARENT] = format_traceparent(trace, span)
    if causation:
        expected["Causation-Id"] = causation
    if correlation:
        expected["Correlation-Id"] = correlation
    assert env.headers() == expected
    assert list(env.headers()) == list(expected)  # header order is part of the bytes


@given(
    payload=payloads,
    position=st.integers(0, 1000),
    trace=ids,
    ts=st.sampled_from(["", "2026-01-01T00:00:00.000000Z"]),
    tenant=st.sampled_from(["default", "acme"]),
    subject=st.sampled_from(
        [
            "evt.default.demo.order.created",
            "evt.acme.demo.order.created",
            "cmd.other.demo.a.b.3",
            "evt..x.y.z",
            "custom.subject",
        ]
    ),
    fields=st.dictionaries(
        st.sampled_from(
            [
                "source",
                "tenant_id",
                "resource_type",
                "resource_id",
                "trace_id",
                "ts",
                "causation_id",
                "not_before_ts",
                "extra",
            ]
        ),
        st.none() | tokens | st.sampled_from(["default", "acme"]),
        max_size=4,
    ),
)
def test_child_message_is_the_child_sent(
    payload: dict[str, Any], position: int, trace: str | None, ts: str, tenant: str, subject: str,
    fields: dict[str, Any],
) -> None:  # fmt: skip
    if "extra" in fields:
        fields["extra"] = {"x": fields["extra"]}
    cmd = Envelope.new(
        "order.create", {"sku": "A"}, trace_id=trace, tenant_id=tenant, ts=ts, resource_id="r"
    )
    expected = Outbound.of(subject, cmd.child("order.created", payload, position, **fields))
    msg_id, data, headers = cmd.child_message(subject, "order.created", payload, position, **fields)
    got = Outbound(subject, data, headers, msg_id)
    if ts:
        assert got == expected
    else:  # the children's ts is the time each was made
        assert json.loads(got.data) | {"ts": ""} == json.loads(expected.data) | {"ts": ""}
        assert (got.subject, got.headers, got.msg_id) == (
            expected.subject,
            expected.headers,
            expected.msg_id,
        )
    assert list(got.headers) == list(expected.headers)
