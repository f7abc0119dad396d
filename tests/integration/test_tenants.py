"""Two tenants on one runtime: the subject is the tenant, and nothing kept crosses tenants.

Each test runs the demo agents against a server of its own, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from test_engine_support import (
    EventWatchFor,
    dead_letters_of,
    open_conn,
    running,
    settings_for,
    wait_until,
)

from meshforge.config import Settings, load_settings
from meshforge.demo import InventoryAgent, OrderAgent
from meshforge.envelope import Envelope
from meshforge.errors import OverlapError, TopologyError
from meshforge.publish.publisher import Publisher
from meshforge.store import Store, open_store
from meshforge.store.base import EffectRecord
from meshforge.topology.scope import Scope
from meshforge.topology.specs import agent_consumer
from meshforge.transport.connection import Connection
from meshforge.transport.server import EmbeddedServer

NS = "demo"


class Tenants:
    """A connection, an event watch and a way to send commands as a tenant."""

    def __init__(self, conn: Connection, watch: EventWatchFor, store: Store | None = None) -> None:
        self.conn, self.watch, self.store = conn, watch, store
        self.publisher = Publisher(conn.js)

    async def effects(self) -> list[EffectRecord]:
        assert self.store is not None
        return await asyncio.to_thread(lambda: list(self.store.effects_read()))  # type: ignore[union-attr]

    async def ask(
        self, tenant: str, command: str, payload: dict[str, Any], *,
        headers: dict[str, str] | None = None, **fields: Any,
    ) -> Envelope:  # fmt: skip
        fields.setdefault("tenant_id", tenant)
        env = Envelope.new(command, payload, source="test", **fields)
        await self.publisher.publish(f"cmd.{tenant}.{NS}.{command}", env, headers=headers)
        return env

    async def answer(self, env: Envelope) -> Any:
        return await self.watch.caused_by(env)


@pytest.fixture
async def tenants(private_server: EmbeddedServer, own_store_url: str) -> AsyncIterator[Tenants]:
    settings = settings_for(private_server.url, own_store_url)
    conn = await open_conn(settings)
    watch = await EventWatchFor.start(conn, "evt.>")
    store = await asyncio.to_thread(open_store, own_store_url)
    try:
        async with running([OrderAgent(), InventoryAgent()], settings, store=store):
            yield Tenants(conn, watch, store)
    finally:
        await watch.stop()
        await conn.close()
        await asyncio.to_thread(store.close)


async def test_a_tenant_header_or_body_that_is_not_the_subjects_is_rejected(
    tenants: Tenants, own_store_url: str
) -> None:
    order = {"order_id": "o-spoof", "sku": "S1", "qty": 1}
    by_header = await tenants.ask(
        "tenantA", "order.create", order, headers={"Tenant-Id": "tenantB"}
    )
    by_body = await tenants.ask(
        "tenantA", "order.create", order, tenant_id="tenantB", headers={"Tenant-Id": "tenantA"}
    )
    # A command naming its own tenant (or none) is run, and its event carries the subject's.
    plain = await tenants.ask("tenantA", "order.create", {"order_id": "o-ok", "sku": "S1", "qty": 1},
                              headers={"Tenant-Id": ""}, tenant_id="")  # fmt: skip
    created = await tenants.answer(plain)
    assert (created.subject, created.tenant_id) == ("evt.tenantA.demo.order.created", "tenantA")

    async def both_dead() -> bool:
        return len(await dead_letters_of(tenants.conn, "order")) >= 2

    await wait_until(both_dead, what="two dead letters")
    dead = {
        m.headers.get("Nats-Msg-Id"): m.headers
        for m in await dead_letters_of(tenants.conn, "order")
    }
    assert set(dead) == {by_header.id, by_body.id}
    for headers, where in (
        (dead[by_header.id], "Tenant-Id header"),
        (dead[by_body.id], "body tenant_id"),
    ):
        assert headers["Dlq-Reason"] == "rejected"
        error = headers["Dlq-Error"]
        assert (
            where in error and "'tenantB'" in error and "'tenantA'" in error and "\n" not in error
        )
    assert not [s for s in tenants.watch.seen if s.causation_id in (by_header.id, by_body.id)]
    keys = {r.key for r in await tenants.effects()}
    assert by_header.key not in keys and by_body.key not in keys and plain.key in keys


async def test_a_tenant_never_sees_nor_blocks_another_tenants_order(tenants: Tenants) -> None:
    order = {"order_id": "o-1", "sku": "S1", "qty": 2}
    assert (
        await tenants.answer(await tenants.ask("tenantA", "order.create", order))
    ).type == "order.created"

    lookup = await tenants.answer(await tenants.ask("tenantB", "order.get", {"order_id": "o-1"}))
    assert (lookup.type, lookup.subject) == ("order.not_found", "evt.tenantB.demo.order.not_found")

    # The same order id in tenantB is a new order, not an "already exists" leak.
    mine = await tenants.answer(await tenants.ask("tenantB", "order.create", {**order, "qty": 5}))
    assert (mine.type, mine.subject, mine.payload["qty"]) == (
        "order.created", "evt.tenantB.demo.order.created", 5,
    )  # fmt: skip
    theirs = await tenants.answer(await tenants.ask("tenantA", "order.get", {"order_id": "o-1"}))
    assert theirs.type == "order.found" and theirs.payload["order"]["qty"] == 2


async def test_a_tenant_cannot_take_another_tenants_stock(tenants: Tenants) -> None:
    stock = await tenants.ask("tenantA", "inventory.create", {"sku": "S1", "qty": 5})
    assert (await tenants.answer(stock)).type == "inventory.created"
    grab = await tenants.ask(
        "tenantB", "inventory.reserve", {"order_id": "x", "sku": "S1", "qty": 3}
    )
    refused = await tenants.answer(grab)
    assert (refused.type, refused.payload["reason"]) == ("inventory.rejected", "unknown sku")
    assert refused.subject == "evt.tenantB.demo.inventory.rejected"
    level = await tenants.answer(await tenants.ask("tenantA", "inventory.get", {"sku": "S1"}))
    assert level.payload == {"sku": "S1", "qty": 5, "reserved": 0}


async def test_an_idempotency_key_of_one_tenant_never_suppresses_anothers(
    tenants: Tenants, own_store_url: str
) -> None:
    key = "req-shared"
    first = await tenants.ask("tenantA", "order.create", {"order_id": "o-a", "sku": "S1", "qty": 1},
                              idempotency_key=key)  # fmt: skip
    assert (await tenants.answer(first)).payload["order_id"] == "o-a"
    second = await tenants.ask("tenantB", "order.create", {"order_id": "o-b", "sku": "S1", "qty": 1},
                               idempotency_key=key)  # fmt: skip
    done = await tenants.answer(second)
    assert (done.type, done.subject, done.payload["order_id"]) == (
        "order.created", "evt.tenantB.demo.order.created", "o-b",
    )  # fmt: skip
    effects = {r.scope: r.command_id for r in await tenants.effects() if r.key == key}
    assert effects == {Scope("tenantA", NS): first.id, Scope("tenantB", NS): second.id}


def tenant_settings(server: EmbeddedServer, own_store_url: str, tenant: str) -> Settings:
    """Settings of a worker bound to ``tenant`` through MESHFORGE_TENANT."""
    base = settings_for(server.url, own_store_url)
    values = {"nats_url": base.nats_url, "store_url": own_store_url, "ack_wait": 2.0,
              "backoff": (0.2, 0.4, 0.6), "max_deliver": 4, "shutdown_timeout": 5.0}  # fmt: skip
    return load_settings(values, env={"MESHFORGE_TENANT": tenant})


async def test_workers_bound_to_two_tenants_each_keep_their_own_consumer(
    private_server: EmbeddedServer, own_store_url: str
) -> None:
    a = tenant_settings(private_server, own_store_url, "tenantA")
    b = tenant_settings(private_server, own_store_url, "tenantB")
    assert a.tenant == "tenantA"
    conn = await open_conn(a)
    watch = await EventWatchFor.start(conn, "evt.>")
    ask = Tenants(conn, watch)
    try:
        async with running([OrderAgent()], a), running([OrderAgent()], b):
            infos = {
                t: await conn.js.consumer_info("MESHFORGE_COMMANDS", f"order_consumer_{t}_all")
                for t in ("tenantA", "tenantB")
            }
            for tenant in ("tenantA", "tenantB"):
                env = await ask.ask(
                    tenant, "order.create", {"order_id": "o-1", "sku": "S", "qty": 1}
                )
                seen = await ask.answer(env)
                assert seen.subject == f"evt.{tenant}.demo.order.created"
            for tenant, info in infos.items():
                now = await conn.js.consumer_info("MESHFORGE_COMMANDS", info.name)
                assert (
                    now.config.filter_subject
                    == info.config.filter_subject
                    == f"cmd.{tenant}.*.order.>"
                )
    finally:
        await watch.stop()
        await conn.close()


async def test_an_unbound_worker_beside_a_bound_one_is_refused_naming_both(
    private_server: EmbeddedServer, own_store_url: str
) -> None:
    unbound = settings_for(private_server.url, own_store_url)
    bound = tenant_settings(private_server, own_store_url, "tenantA")
    async with running([OrderAgent()], unbound):
        with pytest.raises(OverlapError) as info:
            async with running([OrderAgent()], bound):
                pass
    text = str(info.value)
    assert "order_consumer_tenantA_all" in text and "order_consumer " in text
    assert "cmd.tenantA.*.order.>" in text and "cmd.*.*.order.>" in text and "\n" not in text


async def test_provisioning_never_rewrites_the_filter_a_worker_relies_on(
    private_server: EmbeddedServer, own_store_url: str
) -> None:
    settings = settings_for(private_server.url, own_store_url)
    conn = await open_conn(settings)
    try:
        # A consumer named like the unbound one but filtered to one tenant (as older
        # releases left it): starting an unbound worker must not take it over.
        spec = agent_consumer("order", settings)
        config = spec.config()
        config.filter_subject = "cmd.tenantA.*.order.>"
        await conn.js.add_consumer("MESHFORGE_COMMANDS", config)
        with pytest.raises(TopologyError) as info:
            async with running([OrderAgent()], settings):
                pass
        text = str(info.value)
        assert "order_consumer" in text and "'cmd.tenantA.*.order.>'" in text
        assert "'cmd.*.*.order.>'" in text and "\n" not in text
        kept = await conn.js.consumer_info("MESHFORGE_COMMANDS", "order_consumer")
        assert kept.config.filter_subject == "cmd.tenantA.*.order.>"
    finally:
        await conn.close()


async def test_an_envelope_left_at_the_default_tenant_takes_its_subjects(tenants: Tenants) -> None:
    env = Envelope.new("order.create", {"sku": "A-1", "qty": 1}, source="test")
    assert env.tenant_id == "default"
    await tenants.publisher.publish(f"cmd.acme.{NS}.order.create", env)
    created = await tenants.answer(env)
    assert created.subject.startswith("evt.acme.") and created.tenant_id == "acme"
