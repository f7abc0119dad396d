"""The partition function, partitioned subjects, their scope and their durables."""

from __future__ import annotations

from collections import Counter

import pytest

from meshforge.cli.publish import build_envelope
from meshforge.config import load_settings
from meshforge.envelope import Envelope, decode
from meshforge.errors import ConfigError, InvalidSubject, TopologyError
from meshforge.publish.sync import envelope_for
from meshforge.runtime.agent import Agent, Event, Output, Send
from meshforge.runtime.outputs import build_outputs
from meshforge.topology.partitions import (
    fnv1a_32,
    partition_key,
    partition_of,
    partition_subject,
    partitioned,
)
from meshforge.topology.scope import Scope, command_scope
from meshforge.topology.specs import partition_consumers
from meshforge.topology.subjects import command_parts, overlaps, partitioned_command_subject


@pytest.mark.parametrize(
    ("data", "expected"),
    [(b"", 0x811C9DC5), (b"a", 0xE40C292C), (b"foobar", 0xBF9CF968), (b"foo", 0xA9F37ED7)],
)
def test_fnv1a_32_known_vectors(data: bytes, expected: int) -> None:
    assert fnv1a_32(data) == expected


def test_same_resource_same_partition_and_spread_over_all() -> None:
    assert {partition_of("order-7", 8) for _ in range(5)} == {partition_of("order-7", 8)}
    counts = Counter(partition_of(f"order-{i}", 8) for i in range(8000))
    assert set(counts) == set(range(8))
    assert min(counts.values()) > 800  # about 1000 each: no partition starves
    assert partition_of("x", 1) == 0
    with pytest.raises(ValueError, match="partitions must be >= 1"):
        partition_of("x", 0)


def test_partition_key_is_the_resource_id_else_the_id() -> None:
    with_resource = Envelope.new("order.create", {}, resource_id="order-7")
    without = Envelope.new("order.create", {})
    assert partition_key(with_resource) == "order-7"
    assert partition_key(without) == without.id
    settings = load_settings({"partitions": 4}, env={})
    assert partitioned("cmd.default.demo.order.create", with_resource, settings) == (
        "cmd.default.demo.order.create.3"
    )
    assert partitioned("cmd.default.demo.order.create", with_resource, load_settings(env={})) == (
        "cmd.default.demo.order.create"
    )


def test_partition_subject_leaves_events_and_partitioned_subjects_alone() -> None:
    assert (
        partition_subject("evt.default.demo.order.created", "k", 4)
        == "evt.default.demo.order.created"
    )
    assert (
        partition_subject("cmd.default.demo.order.create.1", "order-7", 4)
        == "cmd.default.demo.order.create.1"
    )
    assert (
        partition_subject("cmd.default.demo.order.create", "order-7", 0)
        == "cmd.default.demo.order.create"
    )


def test_command_parts_and_scope_of_six_token_subjects() -> None:
    assert (
        partitioned_command_subject("acme", "shop", "order", "create", 12)
        == "cmd.acme.shop.order.create.12"
    )
    with pytest.raises(InvalidSubject, match="invalid partition"):
        partitioned_command_subject("acme", "shop", "order", "create", -1)
    assert command_parts("cmd.acme.shop.order.create.12") == ("acme", "shop", "order", "create", 12)
    assert command_parts("cmd.acme.shop.order.create.x") is None
    assert command_parts("evt.acme.shop.order.created") is None
    assert command_scope("cmd.acme.shop.order.create.12") == Scope("acme", "shop")
    assert Scope.of_subject("cmd.acme.shop.order.create.x") is None


def test_partition_durables_have_disjoint_filters() -> None:
    settings = load_settings({"partitions": 3}, env={})
    specs = partition_consumers("order", settings)
    assert {s.durable for s in specs.values()} == {
        "order_consumer_p0", "order_consumer_p1", "order_consumer_p2", "order_consumer_unpartitioned",
    }  # fmt: skip
    assert specs["u"].filter_subject == "cmd.*.*.order.*"
    filters = [s.filter_subject for s in specs.values()]
    # A work-queue stream refuses overlapping consumer filters.
    assert not any(overlaps(a, b) for i, a in enumerate(filters) for b in filters[i + 1 :])
    bound = partition_consumers("order", settings, tenant="acme")
    assert bound["p1"].durable == "order_consumer_acme_all_p1"
    assert bound["p1"].filter_subject == "cmd.acme.*.order.*.1"
    with pytest.raises(TopologyError, match="partitions must be >= 1"):
        partition_consumers("order", load_settings(env={}))


def test_partitions_setting() -> None:
    assert load_settings(env={}).partitions == 0
    settings = load_settings(env={"MESHFORGE_PARTITIONS": "8", "MESHFORGE_PARTITION_LEASE": "3s"})
    assert (settings.partitions, settings.partition_lease) == (8, 3.0)
    with pytest.raises(
        ConfigError, match="MESHFORGE_PARTITIONS: expected an integer from 0 to 1024"
    ):
        load_settings(env={"MESHFORGE_PARTITIONS": "-1"})


def test_sends_to_a_partitioned_agent_carry_the_partition_of_their_resource() -> None:
    class Pinger(Agent[None]):
        name = "pinger"

        def initial(self) -> None:
            return None

    cmd = Envelope.new("pinger.ping", {}, tenant_id="acme")
    outputs: list[Output] = [
        Event("pinged", {}),
        Send("order", "create", {"x": 1}, resource_id="order-7"),
        Send("order", "create", {"x": 2}),
    ]
    _, stored, _ = build_outputs(
        Pinger(), cmd, "p", "cmd.acme.shop.pinger.ping.2", outputs, None, 4
    )
    assert stored[0].subject == "evt.acme.shop.pinger.pinged"  # events keep five tokens
    assert stored[1].subject == "cmd.acme.shop.order.create.3"
    no_resource = decode(stored[2].data, stored[2].headers)
    assert stored[2].subject == f"cmd.acme.shop.order.create.{partition_of(no_resource.id, 4)}"
    _, unpartitioned, _ = build_outputs(
        Pinger(), cmd, "p", "cmd.acme.shop.pinger.ping", outputs, None
    )
    assert unpartitioned[1].subject == "cmd.acme.shop.order.create"


def test_a_partitioned_subject_names_the_command_not_the_partition() -> None:
    env = build_envelope(
        "cmd.default.demo.order.create.3", '{"sku": "A-1"}', key=None, source="cli"
    )
    assert env.type == "order.create" and env.tenant_id == "default"
    assert envelope_for("cmd.default.demo.order.create.3", {}).type == "order.create"
