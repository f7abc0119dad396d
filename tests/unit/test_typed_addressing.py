"""``meshforge.publish.typed``: the subject a typed payload goes to, below the runtime."""

from __future__ import annotations

import pytest

from meshforge.config import load_settings
from meshforge.demo.agents import CreateStock, GetOrder, InventoryAgent, OrderAgent
from meshforge.errors import ConfigError
from meshforge.publish.typed import addressed, command_for
from meshforge.runtime import agent
from meshforge.topology.partitions import partition_of


def test_the_runtime_and_the_publishers_share_one_resolver() -> None:
    assert agent.command_for is command_for
    assert command_for(InventoryAgent, CreateStock(sku="A", qty=1)) == ("inventory", "create")
    with pytest.raises(ConfigError, match="is not an Agent class"):
        command_for(dict, CreateStock(sku="A", qty=1))


def test_addressed_partitions_by_the_declared_key_and_takes_the_settings_scope() -> None:
    settings = load_settings({"partitions": 4, "tenant": "acme", "namespace": "shop"}, env={})
    subject, env = addressed(InventoryAgent, CreateStock(sku="A-1", qty=5), settings)
    assert subject == f"cmd.acme.shop.inventory.create.{partition_of('A-1', 4)}"
    assert (env.type, env.tenant_id, env.resource_id) == ("inventory.create", "acme", "A-1")
    subject, env = addressed(
        OrderAgent, GetOrder(order_id="o-7"), load_settings(env={}), namespace="demo",
        resource_id="r-1", source="shop-web",
    )  # fmt: skip
    assert subject == "cmd.default.demo.order.get"
    assert (env.resource_id, env.source, env.payload) == ("r-1", "shop-web", {"order_id": "o-7"})
