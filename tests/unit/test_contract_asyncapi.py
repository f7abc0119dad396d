"""``meshforge.contract``: the AsyncAPI document of agents and nodes, checked against the
official AsyncAPI 3.0.0 JSON Schema (a pinned copy, tests/unit/asyncapi/README.md) and
against the bytes MeshForge really sends."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import jsonschema
import msgspec
import pydantic
import pytest

from meshforge.contract import asyncapi, payload_schemas
from meshforge.control.node import CommandContext, Node, command
from meshforge.control.reply import reply_envelope
from meshforge.demo import DemoNode, InventoryAgent, OrderAgent
from meshforge.envelope import Envelope, Outbound
from meshforge.errors import ConfigError
from meshforge.runtime.agent import Agent, Command, Event, Output
from meshforge.runtime.agent import command as agent_command
from meshforge.transport.headers import RESERVED

HERE = Path(__file__).parent / "asyncapi"
OFFICIAL = HERE / "asyncapi-3.0.0.json"


@pytest.fixture(scope="module")
def official() -> jsonschema.Draft7Validator:
    schema = json.loads(OFFICIAL.read_text(encoding="utf-8"))
    return jsonschema.Draft7Validator(
        schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER
    )


def _errors(validator: jsonschema.Draft7Validator, doc: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}"
        for e in validator.iter_errors(doc)
    ]


def _demo() -> dict[str, Any]:
    return asyncapi([OrderAgent, InventoryAgent], [DemoNode()])


def test_the_pinned_schema_is_the_one_its_readme_names() -> None:
    named = re.search(r"sha256 `([0-9a-f]{64})`", (HERE / "README.md").read_text(encoding="utf-8"))
    assert named and hashlib.sha256(OFFICIAL.read_bytes()).hexdigest() == named.group(1)


def test_the_demo_agents_and_node_make_a_document_the_official_schema_accepts(
    official: jsonschema.Draft7Validator,
) -> None:
    doc = _demo()
    assert doc["asyncapi"] == "3.0.0"
    assert _errors(official, doc) == []


@pytest.mark.parametrize(
    ("what", "spoil"),
    [
        (
            "an AsyncAPI 2 verb",
            lambda d: d["operations"]["cmd.order.create"].update(action="publish"),
        ),
        ("a channel address that is a number", lambda d: d["channels"]["failed"].update(address=7)),
        ("info without a version", lambda d: d["info"].pop("version")),
        (
            "an operation without its channel",
            lambda d: d["operations"]["evt.order.created"].pop("channel"),
        ),
        (
            "a message with an unknown field",
            lambda d: d["components"]["messages"]["cmd.order.get"].update(topic="x"),
        ),
    ],
)
def test_the_official_schema_refuses_a_broken_document(
    official: jsonschema.Draft7Validator, what: str, spoil: Any
) -> None:
    doc = copy.deepcopy(_demo())
    spoil(doc)
    assert _errors(official, doc), f"{what} was accepted"


def test_every_command_and_event_of_each_agent_is_a_channel_and_an_operation() -> None:
    doc = _demo()
    wanted = {
        "cmd.order.create": "receive", "cmd.order.get": "receive",
        "evt.order.created": "send", "evt.order.found": "send", "evt.order.not_found": "send",
        "cmd.inventory.create": "receive", "cmd.inventory.reserve": "receive",
        "cmd.inventory.get": "receive", "evt.inventory.created": "send",
        "evt.inventory.reserved": "send", "evt.inventory.rejected": "send",
        "evt.inventory.found": "send", "evt.inventory.not_found": "send",
    }  # fmt: skip
    for name, action in wanted.items():
        kind, agent, verb = name.split(".")
        channel = doc["channels"][name]
        assert channel["address"] == f"{kind}.{{tenant}}.{{namespace}}.{agent}.{verb}"
        assert set(channel["parameters"]) == {"tenant", "namespace"}
        assert doc["operations"][name]["action"] == action
    assert {n for n in doc["channels"] if n.startswith(("cmd.", "evt."))} == set(wanted)
    for name in ("echo", "sleep", "restart"):
        operation = doc["operations"][f"control.DemoNode.{name}"]
        assert operation["action"] == "receive"
        assert operation["reply"]["channel"] == {"$ref": "#/channels/control.reply"}
    assert doc["channels"]["control.cmd.DemoNode"]["address"] == "control.cmd.{site}.{node}"
    assert doc["channels"]["control.reply"]["address"] == "control.reply.{site}.{node}"


def test_every_envelope_and_reserved_header_is_described() -> None:
    schemas = _demo()["components"]["schemas"]
    envelope = set(schemas["EnvelopeHeaders"]["properties"])
    assert envelope == {"Nats-Msg-Id", "Idempotency-Key", "Tenant-Id", "Schema-Version",
                        "traceparent", "Causation-Id", "Correlation-Id"}  # fmt: skip
    assert set(Envelope.new("a.b", {}, causation_id="c").headers()) <= envelope
    reserved = set(schemas["DeadLetterHeaders"]["properties"]) | set(
        schemas["OriginalChunkHeaders"]["properties"]
    )
    assert set(RESERVED) <= reserved


def _refs(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        if isinstance(value.get("$ref"), str):
            yield value["$ref"]
        for item in value.values():
            yield from _refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def test_every_reference_in_the_document_resolves() -> None:
    doc = asyncapi([OrderAgent, InventoryAgent, TypedAgent, ShopAgent], [DemoNode(), QuotedNode()])
    refs = set(_refs(doc))
    assert "#/components/schemas/Envelope" in refs
    for ref in refs:
        _resolve(doc, ref)


def _body_validator(doc: dict[str, Any], message: str, part: str) -> jsonschema.Draft7Validator:
    """A validator of a message's ``payload`` or ``headers`` schema, its references
    resolved in the whole document."""
    return jsonschema.Draft7Validator({**doc, "$ref": f"#/components/messages/{message}/{part}"})


def test_what_the_runtime_sends_fits_its_message() -> None:
    doc = _demo()
    command = Envelope.new("order.create", {"sku": "A-1", "qty": 2}, source="test")
    sent = Outbound.of("cmd.acme.demo.order.create", command)
    assert _errors(_body_validator(doc, "cmd.order.create", "payload"), json.loads(sent.data)) == []
    assert _errors(_body_validator(doc, "cmd.order.create", "headers"), sent.headers) == []
    created = {"order_id": "o-1", "sku": "A-1", "qty": 2}  # the demo's OrderCreated
    event = command.child("order.created", created, position=0)
    assert _errors(_body_validator(doc, "evt.order.created", "payload"), event.to_dict()) == []
    # The type is the message's: an event is not a command.
    assert _errors(_body_validator(doc, "cmd.order.create", "payload"), event.to_dict())
    nudge = Envelope.new("echo", {"hi": 1}, deadline_ts="2030-01-01T00:00:00Z", extra={"job": "j"})
    assert _errors(_body_validator(doc, "control.DemoNode.echo", "payload"), nudge.to_dict()) == []
    reply = reply_envelope(
        nudge, site="s", node="n", status="ok", result=1, error=None, node_epoch=2
    )
    assert _errors(_body_validator(doc, "control.reply", "payload"), reply.to_dict()) == []
    assert _errors(_body_validator(doc, "control.reply", "headers"), reply.headers()) == []
    broken = {**reply.to_dict(), "payload": {"status": "fine"}}
    assert _errors(_body_validator(doc, "control.reply", "payload"), broken)


def test_a_bound_tenant_narrows_the_tenant_parameter() -> None:
    tenant = asyncapi([OrderAgent], tenant="acme")["components"]["parameters"]["tenant"]
    assert tenant["enum"] == ["acme"] and tenant["default"] == "acme"


# ---- declarations ------------------------------------------------------------------


class TypedState(msgspec.Struct):
    n: int = 0


class TypedAgent(Agent[TypedState]):
    """Counts <script>alert(1)</script> things."""

    name = "typed"

    @agent_command("add", key="n")
    def add(self, cmd: Envelope, state: TypedState) -> list[Output]:
        """Adds to the count."""
        name = "computed"
        return [Event("added", {}), Event(name, {}), Event(name="named", payload={})]

    def helper(self) -> Event:
        return Event("from_helper")

    def not_a_token(self) -> Event:
        return Event("not a token")


class QuotedNode(Node):
    """A node of <b>bold</b> claims."""

    @command()
    async def ping(self, payload: dict[str, Any], ctx: CommandContext) -> Any:
        """Answers pong."""
        return "pong"


def test_events_named_literally_in_the_agent_class_are_its_events() -> None:
    doc = asyncapi([TypedAgent])
    events = sorted(n for n in doc["channels"] if n.startswith("evt."))
    assert events == ["evt.typed.added", "evt.typed.from_helper", "evt.typed.named"]


def test_descriptions_come_from_docstrings() -> None:
    doc = asyncapi([TypedAgent], [QuotedNode()])
    assert doc["components"]["messages"]["cmd.typed.add"]["description"] == "Adds to the count."
    assert doc["operations"]["control.QuotedNode.ping"]["description"] == "Answers pong."
    tags = {tag["name"]: tag["description"] for tag in doc["info"]["tags"]}
    assert "<script>alert(1)</script>" in tags["typed"]
    # A class without a docstring does not show its base's.
    bare = asyncapi([ShopAgent])["info"]["tags"][0]["description"]
    assert bare == "The agent `shop`."


def test_an_agent_or_node_given_twice_is_refused_with_one_line() -> None:
    with pytest.raises(ConfigError, match="given twice"):
        asyncapi([OrderAgent, OrderAgent()])
    with pytest.raises(ConfigError, match="given twice"):
        payload_schemas([], [DemoNode(), DemoNode()])


def test_the_payload_schemas_are_one_json_schema_document() -> None:
    doc = payload_schemas([OrderAgent], [DemoNode()])
    jsonschema.Draft202012Validator.check_schema(doc)
    assert {
        "cmd.order.create",
        "evt.order.created",
        "control.DemoNode.echo",
        "control.reply",
    } <= set(doc["$defs"])
    for ref in _refs(doc):
        _resolve(doc, ref)
    reply = jsonschema.Draft202012Validator({**doc, "$ref": "#/$defs/control.reply"})
    assert not list(
        reply.iter_errors({"status": "ok", "result": None, "error": None, "node_epoch": 1})
    )
    assert list(reply.iter_errors({"status": "maybe"}))


# ---- typed payloads ----------------------------------------------------------------


class PlaceOrder(msgspec.Struct):
    order_id: str
    qty: int
    note: str | None = None


@dataclass
class Cancel:
    order_id: str
    reason: str = ""


class Address(pydantic.BaseModel):
    street: str
    city: str


class Shipping(pydantic.BaseModel):
    order_id: str
    to: Address


class Line(msgspec.Struct):
    sku: str
    qty: int


class OrderPlaced(msgspec.Struct):
    order_id: str
    lines: list[Line]


# Another type of the same name, as two modules may each have one.
OtherPlaceOrder = msgspec.defstruct("PlaceOrder", [("sku", str)])


class Envelope_(msgspec.Struct):
    """A payload type that happens to share its name with MeshForge's envelope schema."""

    sealed: bool


Envelope_.__name__ = Envelope_.__qualname__ = "Envelope"


class ShopState(msgspec.Struct):
    placed: bool = False


class ShopAgent(Agent[ShopState]):
    name = "shop"
    events: ClassVar[Mapping[str, type]] = {"placed": OrderPlaced}

    @agent_command("place", key="order_id")
    def place(self, cmd: Command[PlaceOrder], state: ShopState) -> list[Output]:
        line = Line(sku="A-1", qty=cmd.payload.qty)
        return [Event("placed", OrderPlaced(cmd.payload.order_id, [line])), Event("noted", {})]

    @agent_command("cancel", key="order_id", payload=Cancel)
    def cancel(self, cmd: Command[Cancel], state: ShopState) -> list[Output]:
        return []

    @agent_command("ship", key="order_id")
    def ship(self, cmd: Command[Shipping], state: ShopState) -> list[Output]:
        return []

    @agent_command("restock", payload=OtherPlaceOrder)
    def restock(self, cmd: Envelope, state: ShopState) -> list[Output]:
        return []

    @agent_command("wrap", payload=Envelope_)
    def wrap(self, cmd: Envelope, state: ShopState) -> list[Output]:
        return []

    @agent_command("note")
    def note(self, cmd: Envelope, state: ShopState) -> list[Output]:
        return []


def _payload_of(doc: dict[str, Any], message: str) -> Any:
    return doc["components"]["messages"][message]["payload"]["allOf"][1]["properties"]["payload"]


def test_a_typed_agent_makes_a_document_the_official_schema_accepts(
    official: jsonschema.Draft7Validator,
) -> None:
    doc = asyncapi([ShopAgent])
    assert _errors(official, doc) == []
    for ref in _refs(doc):
        _resolve(doc, ref)
    schemas = doc["components"]["schemas"]
    assert _payload_of(doc, "cmd.shop.place") == {"$ref": "#/components/schemas/PlaceOrder"}
    assert set(schemas["PlaceOrder"]["required"]) == {"order_id", "qty"}
    assert _payload_of(doc, "cmd.shop.cancel") == {"$ref": "#/components/schemas/Cancel"}
    assert _payload_of(doc, "cmd.shop.ship") == {"$ref": "#/components/schemas/Shipping"}
    assert "Address" in schemas  # Pydantic's nested model, hoisted out of its $defs
    assert _payload_of(doc, "evt.shop.placed") == {"$ref": "#/components/schemas/OrderPlaced"}
    assert "Line" in schemas
    # Two different types named PlaceOrder are both kept, told apart.
    assert _payload_of(doc, "cmd.shop.restock") == {"$ref": "#/components/schemas/PlaceOrder_2"}
    assert schemas["PlaceOrder_2"]["required"] == ["sku"]
    # A type named as one of the document's own schemas leaves that schema alone.
    assert _payload_of(doc, "cmd.shop.wrap") == {"$ref": "#/components/schemas/Envelope_2"}
    assert schemas["Envelope_2"]["required"] == ["sealed"]
    assert "payload" in schemas["Envelope"]["properties"]
    # Dict payloads stay free objects.
    assert _payload_of(doc, "cmd.shop.note")["type"] == "object"
    assert _payload_of(doc, "evt.shop.noted")["type"] == "object"


def test_a_typed_body_fits_its_message_and_a_wrong_field_does_not() -> None:
    doc = asyncapi([ShopAgent])
    validator = _body_validator(doc, "cmd.shop.place", "payload")
    good = Envelope.new("shop.place", msgspec.to_builtins(PlaceOrder("o-1", 2)))
    assert _errors(validator, good.to_dict()) == []
    for payload in ({"order_id": "o-1", "qty": "2"}, {"order_id": "o-1"}):
        assert _errors(validator, Envelope.new("shop.place", payload).to_dict()), payload
    shipping = _body_validator(doc, "cmd.shop.ship", "payload")
    to = {"street": "Main 1", "city": "Oslo"}
    assert _errors(shipping, Envelope.new("shop.ship", {"order_id": "o", "to": to}).to_dict()) == []
    bad = {"order_id": "o", "to": {"street": "Main 1"}}
    assert _errors(shipping, Envelope.new("shop.ship", bad).to_dict())


def test_the_typed_payload_schemas_refer_to_their_own_defs() -> None:
    doc = payload_schemas([ShopAgent])
    jsonschema.Draft202012Validator.check_schema(doc)
    assert doc["$defs"]["cmd.shop.place"] == {"$ref": "#/$defs/PlaceOrder"}
    for ref in _refs(doc):
        _resolve(doc, ref)
    placed = jsonschema.Draft202012Validator({**doc, "$ref": "#/$defs/evt.shop.placed"})
    assert not list(placed.iter_errors({"order_id": "o", "lines": [{"sku": "A", "qty": 1}]}))
    assert list(placed.iter_errors({"order_id": "o", "lines": [{"sku": "A"}]}))
