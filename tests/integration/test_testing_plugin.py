"""The pytest plugin's live fixtures: a real worker on the session server, a fresh topology."""

from __future__ import annotations

from meshforge.demo import InventoryAgent, OrderAgent
from meshforge.testing.plugin import _Workers
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.connection import Connection


async def test_agent_worker_runs_commands_and_shows_events_state_and_dead_letters(
    agent_worker: _Workers,
) -> None:
    async with agent_worker(OrderAgent(), InventoryAgent()) as h:
        await h.send("inventory", "create", {"sku": "A-1", "qty": 5})
        await h.send("order", "create", {"order_id": "o-1", "sku": "A-1", "qty": 2})
        await h.send("order", "create", {"sku": "A-1", "qty": -1})
        [reserved] = await h.wait_events("inventory.reserved")
        assert reserved.payload == {"order_id": "o-1", "sku": "A-1", "qty": 2}
        assert (await h.state("order", "o-1")).status == "created"
        assert (await h.state("inventory", "A-1")).reserved == 2
        [letter] = await h.wait_dead_letters(1)
        assert letter.reason == "invalid_payload" and "at `$.qty`" in letter.error
        types = [e.type for e in await h.events()]
        assert sorted(types) == ["inventory.created", "inventory.reserved", "order.created"]


async def test_each_connection_starts_on_empty_streams(meshforge_connection: Connection) -> None:
    js = meshforge_connection.js
    await js.publish("cmd.default.test.x.y", b"{}")
    assert (await js.stream_info(STREAM_COMMANDS)).state.messages == 1


async def test_and_the_next_one_does_not_see_the_last_ones_messages(
    meshforge_connection: Connection,
) -> None:
    assert (await meshforge_connection.js.stream_info(STREAM_COMMANDS)).state.messages == 0


async def test_agent_worker_on_a_deliver_group(agent_worker: _Workers) -> None:
    async with agent_worker(InventoryAgent(), deliver_group="stock") as h:
        await h.send("inventory", "create", {"sku": "B-1", "qty": 1})
        await h.wait_events("inventory.created")
        info = await h.conn.js.consumer_info(STREAM_COMMANDS, "inventory_consumer")
        assert info.config.deliver_group == "stock"
