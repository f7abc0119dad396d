"""The agent API: declaring commands, keys, state codecs, outputs, replay hashing."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec
import pytest

from meshforge.demo.agents import InventoryAgent, InventoryState, OrderAgent, OrderState
from meshforge.envelope import Envelope, decode, derive_id
from meshforge.errors import ConfigError, InvalidSubject, Unrecoverable
from meshforge.runtime import SINGLETON, Agent, Event, Output, Send, command, derive_uuid
from meshforge.runtime.outputs import build_outputs, normalize_payload, scope_of
from meshforge.runtime.replay import state_hash
from meshforge.store.base import StoredEvent
from meshforge.testing.harness import AgentHarness


class Tally(msgspec.Struct):
    total: int = 0


class TallyAgent(Agent[Tally]):
    name = "tally"

    @command("add", key="tally_id")
    def add(self, cmd: Envelope, state: Tally) -> list[Output]:
        return [Event("added", {"n": int(cmd.payload["n"]), "before": state.total})]

    @command("ping")
    async def ping(self, cmd: Envelope, state: Tally) -> Output:
        return Send("other", "pong", {"total": state.total}, resource_id="r1")

    @command("nothing")
    def nothing(self, cmd: Envelope, state: Tally) -> None:
        return None

    @command("bad")
    def bad(self, cmd: Envelope, state: Tally) -> list[Output]:
        return ["not an output"]  # type: ignore[list-item]

    def apply(self, state: Tally, event: Event) -> Tally:
        if event.name == "added":
            return Tally(total=state.total + event.payload["n"])
        return state


@dataclass
class Box:
    items: list[str]

    @classmethod
    def initial(cls) -> Box:
        return cls(items=["seed"])


class BoxAgent(Agent[Box]):
    name = "box"


def cmd(type_: str, payload: dict[str, object], **fields: object) -> Envelope:
    return Envelope.new(type_, payload, ts="2026-01-01T00:00:00.000000Z", **fields)


def test_commands_are_collected_by_name() -> None:
    assert set(TallyAgent.commands()) == {"add", "ping", "nothing", "bad"}
    assert TallyAgent.state_type is Tally
    assert BoxAgent.commands() == {}


def test_subclass_inherits_and_overrides_commands() -> None:
    class Louder(TallyAgent):
        name = "louder"

        @command("add", key="tally_id")
        def add2(self, cmd: Envelope, state: Tally) -> list[Output]:
            return [Event("added", {"n": 2 * int(cmd.payload["n"])})]

    specs = Louder.commands()
    assert specs["add"].handler is Louder.add2
    assert "ping" in specs


def test_agent_without_name_or_state_type_is_refused() -> None:
    class NoName(Agent[Tally]):
        pass

    with pytest.raises(ConfigError, match="name"):
        NoName()

    class BadName(Agent[Tally]):
        name = "has.dot"

    with pytest.raises(InvalidSubject):
        BadName()

    class NoState(Agent):  # type: ignore[type-arg]
        name = "nostate"

    with pytest.raises(ConfigError, match="state type"):
        NoState()


def test_command_name_must_be_a_token() -> None:
    with pytest.raises(InvalidSubject):
        command("two words")


def test_initial_state_uses_initial_or_constructor() -> None:
    assert TallyAgent().initial() == Tally(total=0)
    assert BoxAgent().initial() == Box(items=["seed"])


def test_state_codec_round_trips_struct_and_dataclass() -> None:
    agent = TallyAgent()
    assert agent.decode_state(agent.encode_state(Tally(total=7))) == Tally(total=7)
    box = BoxAgent()
    assert box.decode_state(box.encode_state(Box(items=["a", "b"]))) == Box(items=["a", "b"])


def test_resource_key_from_field_callable_resource_id_or_singleton() -> None:
    agent = TallyAgent()
    specs = agent.commands()
    assert agent.resource_key(cmd("tally.add", {"tally_id": "t1", "n": 1}), specs["add"]) == "t1"
    assert agent.resource_key(cmd("tally.add", {"tally_id": 42, "n": 1}), specs["add"]) == "42"
    with pytest.raises(Unrecoverable, match="lacks 'tally_id'"):
        agent.resource_key(cmd("tally.add", {"n": 1}), specs["add"])
    with pytest.raises(Unrecoverable, match="non-empty string"):
        agent.resource_key(cmd("tally.add", {"tally_id": "", "n": 1}), specs["add"])
    assert agent.resource_key(cmd("tally.ping", {}, resource_id="r9"), specs["ping"]) == "r9"
    assert agent.resource_key(cmd("tally.ping", {}), specs["ping"]) == SINGLETON


async def test_handle_accepts_sync_async_single_and_none() -> None:
    agent = TallyAgent()
    specs = agent.commands()
    out = await agent.handle(
        specs["add"], cmd("tally.add", {"tally_id": "t", "n": 3}), Tally(total=1)
    )
    assert out == [Event("added", {"n": 3, "before": 1})]
    out = await agent.handle(specs["ping"], cmd("tally.ping", {}), Tally(total=5))
    assert out == [Send("other", "pong", {"total": 5}, resource_id="r1")]
    assert await agent.handle(specs["nothing"], cmd("tally.nothing", {}), Tally()) == []
    with pytest.raises(Unrecoverable, match="expected Event or Send"):
        await agent.handle(specs["bad"], cmd("tally.bad", {}), Tally())


def test_build_outputs_derives_ids_subjects_trace_and_folds_events() -> None:
    agent = TallyAgent()
    c = cmd("tally.add", {"tally_id": "t", "n": 2}, tenant_id="acme")
    outputs: list[Output] = [
        Event("added", {"n": 2}),
        Send("other", "pong", {"x": 1}, resource_id="r1"),
    ]
    state, stored, events = build_outputs(
        agent, c, "t", "cmd.acme.shop.tally.add", outputs, Tally(total=1)
    )
    assert state == Tally(total=3)
    assert [o.subject for o in stored] == ["evt.acme.shop.tally.added", "cmd.acme.shop.other.pong"]
    assert [o.msg_id for o in stored] == [derive_id(c.id, 0), derive_id(c.id, 1)]
    assert [o.position for o in stored] == [0, 1]
    event = decode(stored[0].data, stored[0].headers)
    assert event.type == "tally.added" and event.causation_id == c.id
    assert event.trace_id == c.trace_id and event.span_id != c.span_id
    assert event.ts == c.ts and event.resource_id == "t" and event.source == "tally"
    sent = decode(stored[1].data, stored[1].headers)
    assert sent.type == "other.pong" and sent.resource_id == "r1" and sent.key == sent.id
    assert len(events) == 1
    assert events[0].event_id == stored[0].msg_id and events[0].resource_id == "t"
    assert msgspec.json.decode(events[0].data) == {"n": 2}
    # Computing the outputs again gives the very same bytes: a re-publish is the same message.
    _, again, _ = build_outputs(agent, c, "t", "cmd.acme.shop.tally.add", outputs, Tally(total=1))
    assert again == stored


def test_build_outputs_refuses_bad_event_names_and_unencodable_payloads() -> None:
    agent = TallyAgent()
    c = cmd("tally.add", {"tally_id": "t", "n": 2})
    with pytest.raises(InvalidSubject):
        build_outputs(agent, c, "t", "cmd.default.demo.tally.add", [Event("bad name", {})], Tally())
    with pytest.raises(TypeError):
        build_outputs(
            agent, c, "t", "cmd.default.demo.tally.add", [Event("x", {"o": object()})], Tally()
        )


def test_normalize_payload_gives_plain_json_values() -> None:
    data, payload = normalize_payload({"t": (1, 2), "s": Tally(total=3)})
    assert payload == {"t": [1, 2], "s": {"total": 3}}
    assert msgspec.json.decode(data) == payload


def test_scope_of_uses_the_subject_tokens() -> None:
    c = cmd("x.y", {}, tenant_id="t9")
    assert scope_of("cmd.acme.shop.order.create", c) == ("acme", "shop")
    assert scope_of("something.else", c) == ("t9", "default")


def test_derive_uuid_is_deterministic() -> None:
    assert derive_uuid("order", "k1") == derive_uuid("order", "k1")
    assert derive_uuid("order", "k1") != derive_uuid("order", "k2")


def _event(pos: int, event_id: str, resource: str, data: bytes) -> StoredEvent:
    return StoredEvent(
        event_id=event_id, type="tally.added", resource_id=resource, command_id="c", key="k",
        data=data, ts="t", agent="tally", position=pos, stored_at=datetime.now(UTC),
    )  # fmt: skip


def test_state_hash_ignores_interleaving_and_key_order_but_not_per_resource_order() -> None:
    a1 = _event(1, "a1", "A", b'{"n":1,"m":2}')
    a2 = _event(2, "a2", "A", b'{"n":2}')
    b1 = _event(3, "b1", "B", b'{"n":3}')
    base = state_hash([a1, a2, b1])
    assert base == state_hash([b1, a1, a2])
    reordered_keys = _event(1, "a1", "A", b'{"m":2, "n":1}')
    assert base == state_hash([reordered_keys, a2, b1])
    assert base != state_hash([a2, a1, b1])
    assert base != state_hash([a1, b1])
    assert base != state_hash([a1, a2, _event(3, "b1", "B", b'{"n":4}')])
    assert len(base) == 64


def test_demo_order_agent_creates_gets_and_validates_by_its_declared_types() -> None:
    h = AgentHarness(OrderAgent())
    created = h.send("create", {"sku": "A", "qty": 2}, idempotency_key="req-1")
    order_id = derive_uuid("order", "req-1")
    assert [e.payload for e in created.events] == [{"order_id": order_id, "sku": "A", "qty": 2}]
    [(subject, reserve)] = created.commands
    assert (subject, reserve.type, reserve.payload, reserve.resource_id) == (
        "cmd.default.test.inventory.reserve", "inventory.reserve",
        {"order_id": order_id, "sku": "A", "qty": 2}, "A",
    )  # fmt: skip
    state = h.state(order_id)
    assert state == OrderState(order_id=order_id, sku="A", qty=2, status="created")
    found = h.send("get", {"order_id": order_id}).event("found")
    assert found.payload == {"order_id": order_id, "order": msgspec.to_builtins(state)}
    assert h.send("get", {"order_id": "zz"}).event("not_found").payload == {"order_id": "zz"}
    again = h.send("create", {"order_id": order_id, "sku": "A", "qty": 2})
    assert again.dead_letter is not None and again.dead_letter.reason == "unrecoverable"
    assert "already exists" in again.dead_letter.error
    for bad, where in (
        ({"qty": 1}, "missing required field `sku`"),
        ({"sku": "A", "qty": "x"}, "Expected `int`, got `str` - at `$.qty`"),
        ({"sku": "A", "qty": 0}, "Expected `int` >= 1 - at `$.qty`"),
        ({"sku": "", "qty": 1}, "Expected `str` of length >= 1 - at `$.sku`"),
        ({"sku": "A", "qty": 1, "order_id": ""}, "at `$.order_id`"),
    ):
        letter = h.send("create", bad).dead_letter
        assert letter is not None and letter.reason == "invalid_payload", bad
        assert "payload does not fit CreateOrder: " in letter.error and where in letter.error
    letter = h.send("get", {}).dead_letter
    assert letter is not None and letter.reason == "invalid_payload"
    assert "missing required field `order_id`" in letter.error


def test_demo_inventory_agent_reserves_until_stock_runs_out() -> None:
    h = AgentHarness(InventoryAgent())
    assert h.send("create", {"sku": "A", "qty": 3}).event("created").payload == {
        "sku": "A", "qty": 3,
    }  # fmt: skip
    assert h.state("A") == InventoryState(sku="A", qty=3, reserved=0, exists=True)
    reserved = h.send("reserve", {"order_id": "o1", "sku": "A", "qty": 2}).event("reserved")
    assert reserved.payload == {"order_id": "o1", "sku": "A", "qty": 2}
    assert h.state("A").reserved == 2
    rejected = h.send("reserve", {"order_id": "o2", "sku": "A", "qty": 2}).event("rejected")
    assert rejected.payload == {"order_id": "o2", "sku": "A", "qty": 2, "available": 1,
                                "reason": "not enough stock"}  # fmt: skip
    found = h.send("get", {"sku": "A"}).event("found")
    assert found.payload == {"sku": "A", "qty": 3, "reserved": 2}
    assert h.send("get", {"sku": "B"}).event("not_found").payload == {"sku": "B"}
    unknown = h.send("reserve", {"order_id": "o", "sku": "B", "qty": 1}).event("rejected")
    assert unknown.payload["reason"] == "unknown sku"
    letter = h.send("reserve", {"order_id": "o", "sku": "A"}).dead_letter
    assert letter is not None and letter.reason == "invalid_payload"
    assert "missing required field `qty`" in letter.error
