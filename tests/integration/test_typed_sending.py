"""Typed sending: ``Publisher.send`` and ``SyncPublisher.send`` take the subject and the type
from the agent's declaration, and ``meshforge publish --agent`` refuses a payload that does
not fit the declared type before anything is sent."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshforge import SyncPublisher
from meshforge.config import Settings
from meshforge.demo.agents import CreateOrder, CreateStock, GetStock, InventoryAgent, OrderAgent
from meshforge.envelope import decode
from meshforge.errors import ConfigError
from meshforge.publish.publisher import Publisher
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.connection import Connection

SRC = Path(__file__).resolve().parents[2] / "src"


async def stored_commands(conn: Connection) -> list[tuple[str, bytes]]:
    """Every command in the commands stream, as (subject, body)."""
    info = await conn.js.stream_info(STREAM_COMMANDS)
    if not info.state.messages:
        return []
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await conn.js.get_msg(STREAM_COMMANDS, seq)
        assert msg.subject is not None and msg.data is not None
        found.append((msg.subject, msg.data))
    return found


async def test_publisher_send_takes_subject_type_and_resource_from_the_declaration(
    meshforge_connection: Connection, meshforge_settings: Settings
) -> None:
    publisher = Publisher(meshforge_connection.js, meshforge_settings)
    stock = await publisher.send(InventoryAgent, CreateStock(sku="A-1", qty=5), namespace="shop")
    order = await publisher.send(
        OrderAgent, CreateOrder(sku="A-1", qty=2, order_id="o-1"), tenant="acme",
        namespace="shop", resource_id="o-1", idempotency_key="req-1",
    )  # fmt: skip
    [(s1, b1), (s2, b2)] = await stored_commands(meshforge_connection)
    first, second = decode(b1), decode(b2)
    assert s1 == "cmd.default.shop.inventory.create" and first.id == stock.msg_id
    assert (first.type, first.payload, first.resource_id) == (
        "inventory.create", {"sku": "A-1", "qty": 5}, "A-1",  # the key the command declares
    )  # fmt: skip
    assert s2 == "cmd.acme.shop.order.create" and second.id == order.msg_id
    assert (second.type, second.tenant_id, second.idempotency_key, second.resource_id) == (
        "order.create", "acme", "req-1", "o-1",
    )  # fmt: skip
    assert second.payload == {"sku": "A-1", "qty": 2, "order_id": "o-1"}

    # A payload no command of the agent takes is refused before anything is sent.
    with pytest.raises(ConfigError, match=r"agent 'order': no command takes a GetStock payload"):
        await publisher.send(OrderAgent, GetStock(sku="A-1"))
    assert len(await stored_commands(meshforge_connection)) == 2


async def test_typed_commands_sent_by_both_publishers_are_applied_by_a_worker(
    agent_worker, meshforge_settings: Settings
) -> None:
    async with agent_worker(OrderAgent(), InventoryAgent()) as h:
        publisher = Publisher(h.conn.js, meshforge_settings)
        await publisher.send(InventoryAgent, CreateStock(sku="A-1", qty=5), namespace="test")
        with SyncPublisher(meshforge_settings) as sync:
            sent = await asyncio.to_thread(
                sync.send, OrderAgent, CreateOrder(sku="A-1", qty=2, order_id="o-1"),
                namespace="test",
            )  # fmt: skip
        [reserved] = await h.wait_events("inventory.reserved")
        assert reserved.payload == {"order_id": "o-1", "sku": "A-1", "qty": 2}
        [created] = await h.events("order.created")
        assert created.causation_id == sent.msg_id
        assert (await h.state("inventory", "A-1")).reserved == 2


async def test_the_worker_harness_sends_a_typed_payload_as_its_fields(agent_worker) -> None:
    async with agent_worker(InventoryAgent()) as h:
        sent = await h.send("inventory", "create", CreateStock(sku="B-2", qty=3))
        assert sent.payload == {"sku": "B-2", "qty": 3}
        [created] = await h.wait_events("inventory.created")
        assert created.causation_id == sent.id
        assert (await h.state("inventory", "B-2")).qty == 3


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHFORGE_", "PYTEST_"))}
    env["PYTHONPATH"] = str(SRC)
    return subprocess.run(
        [sys.executable, "-m", "meshforge", "publish", *args], env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


async def test_cli_publish_with_agent_refuses_a_payload_that_does_not_fit_in_one_line(
    meshforge_connection: Connection, meshforge_url: str
) -> None:
    subject = "cmd.default.demo.inventory.create"
    agent = ("--agent", "meshforge.demo:InventoryAgent", "--nats-url", meshforge_url)
    refused = {
        '{"sku": "A-1", "qty": "5"}': "error: inventory.create: payload does not fit "
        "CreateStock: Expected `int`, got `str` - at `$.qty`",
        '{"sku": "A-1"}': "error: inventory.create: payload does not fit CreateStock: "
        "Object missing required field `qty`",
        '{"sku": "", "qty": 5}': "error: inventory.create: payload does not fit CreateStock: "
        "Expected `str` of length >= 1 - at `$.sku`",
    }
    for body, message in refused.items():
        done = await asyncio.to_thread(cli, subject, body, *agent)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.strip().splitlines() == [message] or done.stderr.strip().startswith(
            message
        ), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    wrong = await asyncio.to_thread(cli, "cmd.default.demo.order.create", '{"sku": "A"}', *agent)
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == [
        "error: --agent meshforge.demo:InventoryAgent: 'cmd.default.demo.order.create' (type "
        "'order.create') is not a command of agent 'inventory': send it on "
        "cmd.<tenant>.<namespace>.inventory.<command>"
    ]
    unknown = await asyncio.to_thread(
        cli, "cmd.default.demo.inventory.restock", '{"sku": "A"}', *agent
    )
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        "error: --agent meshforge.demo:InventoryAgent: agent 'inventory' has no command "
        "'restock' (commands: create, get, reserve)"
    ]
    assert await stored_commands(meshforge_connection) == []  # nothing was sent

    good = await asyncio.to_thread(cli, subject, '{"sku": "A-1", "qty": 5}', *agent)
    assert good.returncode == 0, good.stderr
    [(stored_subject, body)] = await stored_commands(meshforge_connection)
    assert stored_subject == subject and decode(body).payload == {"sku": "A-1", "qty": 5}
