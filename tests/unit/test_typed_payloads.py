"""Typed payloads: the declared type is inferred or given, decoded once before the handler,
and a payload that does not fit is a dead letter ``invalid_payload`` naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshforge import Command, ConfigError, InvalidPayload
from meshforge.console.letters import REASONS as console_reasons
from meshforge.consume.decisions import REASON_INVALID_PAYLOAD, Action
from meshforge.consume.policy import Cause, FailurePolicy, Outcome
from meshforge.deadletters.route import REASONS
from meshforge.envelope import Envelope
from meshforge.runtime import payloads
from meshforge.runtime.agent import Agent, Event, Output, Send, command, command_for
from meshforge.testing import AgentHarness


class PlaceOrder(msgspec.Struct):
    order_id: str
    qty: int
    note: str | None = None


class OrderPlaced(msgspec.Struct):
    order_id: str
    qty: int


@dataclasses.dataclass
class CancelOrder:
    order_id: str
    why: str = "asked"


class Refund(pydantic.BaseModel):
    order_id: str
    amount: int = pydantic.Field(gt=0)


class Order(msgspec.Struct):
    qty: int = 0
    cancelled: bool = False
    refunded: int = 0
    seen: list[str] = msgspec.field(default_factory=list)


class OrderAgent(Agent[Order]):
    name = "order"
    events = {"placed": OrderPlaced}

    @command("place", key="order_id")
    def place(self, cmd: Command[PlaceOrder], state: Order) -> list[Output]:
        assert isinstance(cmd.payload, PlaceOrder)
        return [Event("placed", OrderPlaced(cmd.payload.order_id, cmd.payload.qty))]

    @command("cancel", key="order_id")
    def cancel(self, cmd: Command[CancelOrder], state: Order) -> list[Output]:
        return [Event("cancelled", {"why": cmd.payload.why})]

    @command("refund", key="order_id", payload=Refund)
    def refund(self, cmd: Command[Any], state: Order) -> list[Output]:
        assert isinstance(cmd.payload, Refund)
        return [Event("refunded", {"amount": cmd.payload.amount})]

    @command("note", key="order_id")
    def note(self, cmd: Envelope, state: Order) -> list[Output]:
        return [Event("noted", {"text": cmd.payload["text"]})]

    def apply(self, state: Order, event: Event) -> Order:
        if event.name == "placed":
            assert isinstance(event.payload, OrderPlaced)  # typed: named in events
            return msgspec.structs.replace(state, qty=state.qty + event.payload.qty)
        if event.name == "cancelled":
            assert type(event.payload) is dict  # not named in events: a dict
            return msgspec.structs.replace(state, cancelled=True)
        if event.name == "refunded":
            return msgspec.structs.replace(state, refunded=event.payload["amount"])
        return msgspec.structs.replace(state, seen=[*state.seen, event.payload["text"]])


def test_the_payload_type_is_inferred_from_the_annotation_or_given() -> None:
    specs = OrderAgent.commands()
    assert specs["place"].payload is PlaceOrder
    assert specs["cancel"].payload is CancelOrder
    assert specs["refund"].payload is Refund
    assert specs["note"].payload is None


def test_an_agent_defined_in_a_function_still_resolves_its_payload_type() -> None:
    class Local(msgspec.Struct):
        k: str

    class LocalAgent(Agent[Order]):
        name = "local"

        @command("x", key="k")
        def x(self, cmd: Command[Local], state: Order) -> list[Output]:
            return []

    assert LocalAgent.commands()["x"].payload is Local


@pytest.mark.parametrize(
    ("declare", "message"),
    [
        (dict(key="nope"), "key='nope' is not a field of PlaceOrder"),
        (dict(payload=OrderPlaced), "payload=OrderPlaced but the handler declares"),
    ],
)
def test_declaration_mistakes_are_config_errors(declare: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):

        class Bad(Agent[Order]):
            name = "bad"

            @command("x", **declare)
            def x(self, cmd: Command[PlaceOrder], state: Order) -> list[Output]:
                return []


def test_a_payload_type_that_is_no_struct_dataclass_or_model_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"msgspec\.Struct, a dataclass or a Pydantic"):
        command("x", payload=int)
    with pytest.raises(ConfigError, match=r"msgspec\.Struct, a dataclass or a Pydantic"):

        class Bad(Agent[Order]):
            name = "bad"
            events = {"happened": str}


def test_typed_dataclass_and_pydantic_commands_run_in_the_harness() -> None:
    h = AgentHarness(OrderAgent())
    placed = h.send("place", PlaceOrder("o-1", 2))
    assert placed.dead_letter is None and placed.event_types == ["order.placed"]
    assert placed.event("placed").payload == {"order_id": "o-1", "qty": 2}
    assert h.send("cancel", CancelOrder("o-1")).event("cancelled").payload == {"why": "asked"}
    assert h.send("refund", Refund(order_id="o-1", amount=5)).dead_letter is None
    assert h.send("note", {"order_id": "o-1", "text": "hi"}).dead_letter is None  # dicts unchanged
    assert h.state("o-1") == Order(qty=2, cancelled=True, refunded=5, seen=["hi"])
    # A dict that fits is decoded into the type as well.
    assert h.send("place", {"order_id": "o-1", "qty": 3}).state == Order(
        qty=5, cancelled=True, refunded=5, seen=["hi"]
    )


@pytest.mark.parametrize(
    ("name", "payload", "error"),
    [
        ("place", {"order_id": "o-1", "qty": "2"}, "Expected `int`, got `str` - at `$.qty`"),
        ("place", {"order_id": "o-1"}, "Object missing required field `qty` - at `$`"),
        ("place", {"order_id": 7, "qty": 1}, "Expected `str`, got `int` - at `$.order_id`"),
        ("cancel", {"order_id": "o-1", "why": None}, "Expected `str`, got `null` - at `$.why`"),
        ("refund", {"order_id": "o-1", "amount": 0}, "greater than 0 - at `$.amount`"),
    ],
)
def test_a_payload_that_does_not_fit_is_an_invalid_payload_dead_letter(
    name: str, payload: dict[str, Any], error: str
) -> None:
    h = AgentHarness(OrderAgent())
    sent = h.send(name, payload)
    assert sent.dead_letter is not None
    assert sent.dead_letter.reason == REASON_INVALID_PAYLOAD == "invalid_payload"
    assert error in sent.dead_letter.error
    assert sent.dead_letter.deliveries == 1  # never retried
    assert sent.events == [] and h.events == []


def test_invalid_payload_is_a_contract_reason_and_never_retried() -> None:
    assert REASON_INVALID_PAYLOAD in REASONS
    assert console_reasons == REASONS  # the console's dead-letter filter offers it too
    policy = FailurePolicy(max_deliver=5, backoff=(1.0,))
    decision = policy.decide(Outcome(Cause.HANDLER, 1, InvalidPayload("at `$.qty`")))
    assert decision.action is Action.DEAD_LETTER and decision.reason == "invalid_payload"


def test_send_to_and_command_for_take_the_names_from_the_declaration() -> None:
    assert command_for(OrderAgent, PlaceOrder("o-1", 1)) == ("order", "place")
    assert command_for(OrderAgent(), Refund(order_id="o", amount=1)) == ("order", "refund")
    send = Send.to(OrderAgent, CancelOrder("o-1"), resource_id="o-1", tenant="acme")
    assert (send.agent, send.command, send.resource_id, send.tenant) == (
        "order", "cancel", "o-1", "acme",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="no command takes a OrderPlaced payload"):
        Send.to(OrderAgent, OrderPlaced("o-1", 1))
    with pytest.raises(ConfigError, match="no command takes a dict payload"):
        command_for(OrderAgent, {"order_id": "o-1"})

    class Twice(Agent[Order]):
        name = "twice"

        @command("a")
        def a(self, cmd: Command[PlaceOrder], state: Order) -> None: ...

        @command("b")
        def b(self, cmd: Command[PlaceOrder], state: Order) -> None: ...

    with pytest.raises(ConfigError, match=r"2 commands \(a, b\) take"):
        command_for(Twice, PlaceOrder("o", 1))


def test_a_typed_send_goes_out_as_its_fields() -> None:
    class Shop(Agent[Order]):
        name = "shop"

        @command("buy")
        def buy(self, cmd: Envelope, state: Order) -> list[Output]:
            return [Send.to(OrderAgent, PlaceOrder("o-9", 4), resource_id="o-9")]

    [(subject, env)] = AgentHarness(Shop()).send("buy").commands
    assert subject == "cmd.default.test.order.place"
    assert env.payload == {"order_id": "o-9", "qty": 4, "note": None}


def test_an_event_whose_payload_does_not_fit_its_declared_type_is_the_handlers_fault() -> None:
    class Sloppy(OrderAgent):
        @command("place", key="order_id")
        def place(self, cmd: Command[PlaceOrder], state: Order) -> list[Output]:
            return [Event("placed", {"order_id": cmd.payload.order_id})]

    sent = AgentHarness(Sloppy()).send("place", PlaceOrder("o-1", 1))
    assert sent.dead_letter is not None and sent.dead_letter.reason == "unrecoverable"
    assert "event 'order.placed'" in sent.dead_letter.error
    assert "missing required field `qty`" in sent.dead_letter.error


@pytest.mark.parametrize("tp", [PlaceOrder, CancelOrder, Refund])
def test_payload_helpers_agree_across_the_three_kinds(tp: type) -> None:
    sample = {"order_id": "o-1", "qty": 1, "amount": 3}
    dec = payloads.decoder(tp)
    assert payloads.decoder(tp) is dec  # shared
    value = dec.decode(msgspec.json.encode(sample))
    assert isinstance(value, tp) and payloads.is_typed(tp)
    assert dec.convert(payloads.to_builtins(value)) == value
    assert dec.decode(payloads.encode(value)) == value
    body = Envelope.new("order.x", payloads.to_builtins(value)).encode()
    assert dec.decode_body(body) == value
    schema = payloads.json_schema(tp)
    assert "order_id" in str(schema)
    with pytest.raises(InvalidPayload, match="order_id"):
        dec.decode(b'{"qty": 1, "amount": 3}')
    assert not payloads.is_typed(dict) and not payloads.is_typed(int)


@given(
    order_id=st.text(min_size=1, max_size=20),
    qty=st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=5), st.none(), st.floats()),
    note=st.one_of(st.none(), st.text(max_size=10), st.integers()),
)
def test_decoding_either_fits_exactly_or_says_where_it_does_not(
    order_id: str, qty: object, note: object
) -> None:
    body = Envelope.new("order.place", {"order_id": order_id, "qty": qty, "note": note}).encode()
    fits = isinstance(qty, int) and (note is None or isinstance(note, str))
    try:
        value = payloads.decoder(PlaceOrder).decode_body(body)
    except InvalidPayload as exc:
        assert not fits
        assert "- at `$." in str(exc) and "$.payload" not in str(exc)
    else:
        assert fits and value == PlaceOrder(order_id, qty, note)  # type: ignore[arg-type]


def test_a_command_is_the_envelope_with_its_payload_decoded_and_the_envelope_untouched() -> None:
    env = Envelope.new(
        "order.place", {"order_id": "o-1", "qty": 1}, resource_id="o-1", deadline_ts=None,
        extra={"x-custom": 1},
    )  # fmt: skip
    cmd = Command.of(env, PlaceOrder("o-1", 1))
    assert isinstance(cmd, Envelope) and type(env) is Envelope
    for f in dataclasses.fields(Envelope):
        if f.name != "payload":
            assert getattr(cmd, f.name) == getattr(env, f.name), f.name
    assert cmd.payload == PlaceOrder("o-1", 1)
    assert env.payload == {"order_id": "o-1", "qty": 1}
    assert cmd.key == env.key


@dataclasses.dataclass
class Shipped:
    carrier: str
    parcels: int = 1


class Paid(pydantic.BaseModel):
    amount: int


class Ledger(msgspec.Struct):
    log: list[str] = msgspec.field(default_factory=list)


class Fulfilment(Agent[Ledger]):
    name = "fulfil"
    events = {"shipped": Shipped, "paid": Paid}

    @command("ship")
    def ship(self, cmd: Envelope, state: Ledger) -> list[Output]:
        return [Event("shipped", Shipped("post")), Event("paid", Paid(amount=3))]

    def apply(self, state: Ledger, event: Event) -> Ledger:
        payload = event.payload
        if isinstance(payload, Shipped):
            return Ledger([*state.log, f"{payload.carrier}x{payload.parcels}"])
        assert isinstance(payload, Paid)
        return Ledger([*state.log, f"paid {payload.amount}"])


def test_dataclass_and_pydantic_events_reach_apply_as_their_types() -> None:
    h = AgentHarness(Fulfilment())
    sent = h.send("ship")
    assert [e.payload for e in sent.events] == [{"carrier": "post", "parcels": 1}, {"amount": 3}]
    assert h.state("_") == Ledger(["postx1", "paid 3"])
