"""The evolution rule of typed events: a payload type may gain fields with defaults, nothing
else. Events stored under the older type replay into the newer one to the same states and
the same state hash; a change that breaks the rule stops replay with the rule's name."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshforge.envelope import Envelope
from meshforge.errors import ConfigError
from meshforge.runtime import payloads
from meshforge.runtime.agent import Agent, Command, Event, Output, command
from meshforge.runtime.replay import replay
from meshforge.runtime.step import Step, failure_policy
from meshforge.store import Store, open_store
from meshforge.store.logtail import append_with_states
from meshforge.topology.scope import DEFAULT_SCOPE
from meshforge.transport.sizes import SizeLimits


class Place(msgspec.Struct):
    order_id: str
    qty: int


class PlacedV1(msgspec.Struct):
    order_id: str
    qty: int


class PlacedV2(msgspec.Struct):
    """V1 plus an optional field: what the rule allows."""

    order_id: str
    qty: int
    channel: str = "web"


class PlacedBroken(msgspec.Struct):
    """V1 plus a required field: what the rule forbids."""

    order_id: str
    qty: int
    warehouse: str


class Totals(msgspec.Struct):
    qty: int = 0
    channels: list[str] = msgspec.field(default_factory=list)


class OrdersV1(Agent[Totals]):
    name = "orders"
    events = {"placed": PlacedV1}

    @command("place", key="order_id")
    def place(self, cmd: Command[Place], state: Totals) -> list[Output]:
        return [Event("placed", PlacedV1(cmd.payload.order_id, cmd.payload.qty))]

    def apply(self, state: Totals, event: Event) -> Totals:
        assert isinstance(event.payload, PlacedV1)
        return Totals(state.qty + event.payload.qty, [*state.channels, "web"])


class OrdersV2(OrdersV1):
    events = {"placed": PlacedV2}
    seen: list[PlacedV2] = []

    def apply(self, state: Totals, event: Event) -> Totals:
        assert isinstance(event.payload, PlacedV2)
        self.seen.append(event.payload)
        return Totals(state.qty + event.payload.qty, [*state.channels, event.payload.channel])


class OrdersBroken(OrdersV1):
    events = {"placed": PlacedBroken}


def store_commands(store: Store, agent: Agent[Totals], commands: list[Place]) -> None:
    """Run ``commands`` through the handler step and store their events and states, as the
    engine's transaction does."""
    step = Step(agent, failure_policy(agent, 1, ()), handler_timeout=5.0)
    spec = agent.commands()["place"]
    states: dict[str, Totals] = {}
    for place in commands:
        env = Envelope.new("orders.place", payloads.to_builtins(place))
        cmd, resource = step.prepare(spec, env, env.encode())
        state = states.get(resource, agent.initial())
        subject = "cmd.default.demo.orders.place"
        new, _, events = asyncio.run(
            step.run(spec, cmd, resource, subject, state, SizeLimits(), DEFAULT_SCOPE)
        )
        states[resource] = new
        with store.transaction() as tx:
            append_with_states(
                tx, agent.name, DEFAULT_SCOPE, events, {resource: agent.encode_state(new)}
            )


@pytest.fixture
def store(tmp_path: Path) -> Any:
    opened = open_store(f"sqlite:///{tmp_path / 'orders.db'}")
    yield opened
    opened.close()


def test_events_stored_before_a_field_was_added_replay_to_the_same_states(store: Store) -> None:
    store_commands(store, OrdersV1(), [Place("o-1", 2), Place("o-2", 1), Place("o-1", 3)])
    before = replay(store, "orders", OrdersV1())
    after = replay(store, "orders", OrdersV2())
    assert before.consistent and after.consistent  # the snapshots V1 stored still match
    assert after.state_hash == before.state_hash
    assert after.snapshot_hash == before.snapshot_hash
    assert after.states == before.states == {
        "o-1": Totals(5, ["web", "web"]), "o-2": Totals(1, ["web"]),
    }  # fmt: skip
    assert OrdersV2.seen[-3:] == [PlacedV2("o-1", 2), PlacedV2("o-2", 1), PlacedV2("o-1", 3)]


def test_a_field_added_without_a_default_stops_replay_naming_the_rule(store: Store) -> None:
    store_commands(store, OrdersV1(), [Place("o-1", 2)])
    with pytest.raises(ConfigError, match="may only gain fields with defaults") as err:
        replay(store, "orders", OrdersBroken())
    assert "missing required field `warehouse`" in str(err.value)


@given(order_id=st.text(max_size=30), qty=st.integers(-(2**63), 2**63 - 1))
def test_any_older_payload_decodes_into_the_newer_type_with_the_default(
    order_id: str, qty: int
) -> None:
    old = payloads.encode(PlacedV1(order_id, qty))
    assert payloads.decoder(PlacedV2).decode(old) == PlacedV2(order_id, qty, "web")
