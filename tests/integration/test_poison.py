"""No message stops a worker: oversized dead letters, headers near 64 KiB, a connection the
server closes, and `dlq redrive --all` while the worker runs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.js import JetStreamContext
from test_engine_support import (
    consumer_idle,
    dead_letters_of,
    ledger_agent,
    open_conn,
    running,
    send,
    settings_for,
    wait_until,
)
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.cli.demo_support import read_stream
from meshforge.deadletters.admin import DeadLetters
from meshforge.demo import InventoryAgent, OrderAgent
from meshforge.envelope import Envelope
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.topology.subjects import STREAM_EVENTS
from meshforge.transport.connection import Connection
from meshforge.transport.server import EmbeddedServer

ORDER = "cmd.default.demo.order.create"


async def order(publisher: Publisher, order_id: str) -> Envelope:
    env = Envelope.new("order.create", {"order_id": order_id, "sku": "S1", "qty": 1}, source="test")
    await publisher.publish(ORDER, env)
    return env


async def created(conn: Connection) -> list[str]:
    """The order ids of every order.created event stored, repeats included."""
    events = await read_stream(conn.js, STREAM_EVENTS, "evt.default.demo.order.created")
    return [str(env.payload["order_id"]) for m in events if (env := m.envelope()) is not None]


async def demo_idle(conn: Connection) -> bool:
    return await consumer_idle(conn, "order") and await consumer_idle(conn, "inventory")


async def poison_then_check(
    server: EmbeddedServer, own_store_url: str, body: bytes, headers: dict[str, str], cut: str
) -> None:
    """Good order, poison, good order with the demo agents running: both orders applied once,
    the poison dead-lettered (truncated, ``cut`` in Dlq-Truncated), the worker still up."""
    settings = settings_for(server.url, own_store_url)
    conn = await open_conn(settings)
    publisher = Publisher(conn.js)
    try:
        async with running([OrderAgent(), InventoryAgent()], settings) as worker:
            await order(publisher, "before")
            await publisher.publish(ORDER, body, headers=headers)
            await order(publisher, "after")
            await wait_until(lambda: demo_idle(conn), within=30, what="the demo agents idle")
            [letter] = await dead_letters_of(conn, "order")
            assert worker.ready.is_set()  # still running, not exited
            await order(publisher, "later")
            await wait_until(
                lambda: _has(conn, "later"), within=20, what="an order after the poison"
            )
        assert sorted(await created(conn)) == ["after", "before", "later"]
        assert letter.headers["Dlq-Reason"] == "malformed"
        assert cut in letter.headers["Dlq-Truncated"]
        letters = DeadLetters(conn.js, publisher)
        whole = await letters.original(await letters.get(letter.seq))
        assert whole.data == body and whole.subject == ORDER
    finally:
        await conn.close()


async def _has(conn: Connection, order_id: str) -> bool:
    return order_id in await created(conn)


async def test_a_body_near_max_payload_is_dead_lettered_and_the_worker_goes_on(
    private_server: EmbeddedServer, own_store_url: str
) -> None:
    conn = await open_conn(settings_for(private_server.url, own_store_url))
    limit = conn.nc.max_payload  # from the server INFO
    await conn.close()
    body = b"\x00not json " * ((limit - 100) // 10)
    await poison_then_check(private_server, own_store_url, body, {}, f"body={len(body)};kept=")


async def test_headers_near_64k_are_dead_lettered_not_stuck(
    private_server: EmbeddedServer, own_store_url: str
) -> None:
    headers = {"X-Big": "h" * 65_440}
    await poison_then_check(private_server, own_store_url, b"{not json", headers, "dropped=X-Big")


async def test_a_connection_the_server_closes_is_reconnected(
    private_server: EmbeddedServer, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = settings_for(private_server.url, sqlite_url)
    conn = await open_conn(settings)
    publisher = Publisher(conn.js)
    try:
        async with running([OrderAgent(), InventoryAgent()], settings) as worker:
            await order(publisher, "one")
            await wait_until(lambda: _has(conn, "one"), what="the first order")
            own: Any = worker._conn
            reconnects = own.reconnects
            # Past the client's own check (it counts the body only): the server answers
            # "-ERR 'Maximum Payload Violation'" and closes the worker's connection.
            limit = own.nc.max_payload
            await own.nc.publish("nowhere.x", b"x" * (limit - 10), headers={"X-Pad": "p" * 100})
            await wait_until(
                lambda: _true(own.reconnects > reconnects), what="the worker's connection back"
            )
            assert "maximum payload violation" in caplog.text.lower()
            await order(publisher, "two")
            await wait_until(lambda: _has(conn, "two"), what="an order after the reconnect")
            assert worker.ready.is_set() and own.current_state() == "connected"
        assert sorted(await created(conn)) == ["one", "two"]
    finally:
        await conn.close()


async def _true(value: bool) -> bool:
    return value


async def test_redrive_all_with_the_worker_running_takes_each_letter_once(
    nats_url: str, sqlite_url: str, js: JetStreamContext
) -> None:
    agent = ledger_agent()
    settings = settings_for(nats_url, sqlite_url)
    conn = await open_conn(settings)
    failed = f"failed.cmd.*.*.{agent.name}.>"
    try:
        async with running([agent], settings, metrics=Metrics()):
            sent = [
                await send(
                    conn, agent.name, "credit", {"account": f"a{i}", "amount": 1, "mode": "invalid"}
                )
                for i in range(21)
            ]
            await wait_until(lambda: _count(conn, agent.name, 21), what="21 dead letters")
            first = {m.seq for m in await dead_letters_of(conn, agent.name)}

            runner = CliRunner(env={"COLUMNS": "200"})
            args = ["dlq", "redrive", "--all", "--subject", failed, "--nats-url", nats_url]
            out = await asyncio.wait_for(asyncio.to_thread(runner.invoke, app, args), 30)
            assert out.exit_code == 0, out.output
            assert "21 dead letter(s) re-driven" in out.stdout
            assert {
                int(line.split()[1])
                for line in out.stdout.splitlines()
                if line.startswith("re-drove")
            } == first

            # Each fails again once: 21 new dead letters, ids derived from the first one.
            await wait_until(
                lambda: _count(conn, agent.name, 21, exclude=first), what="second round"
            )
            await wait_until(lambda: consumer_idle(conn, agent.name))
            second = await dead_letters_of(conn, agent.name)
            ids = {env.id: m.headers["Nats-Msg-Id"] for m in second if (env := m.envelope())}
            assert sorted(ids) == sorted(e.id for e in sent)
            assert all(
                v.startswith(f"{k}-redrive-") and v.count("-redrive-") == 1 for k, v in ids.items()
            )

            out = await asyncio.wait_for(asyncio.to_thread(runner.invoke, app, args), 30)
            assert "21 dead letter(s) re-driven" in out.stdout
            await wait_until(
                lambda: _count(conn, agent.name, 21, exclude=first | {m.seq for m in second})
            )
            third = await dead_letters_of(conn, agent.name)
            assert all(m.headers["Nats-Msg-Id"].count("-redrive-") == 1 for m in third)
    finally:
        await js.purge_stream("MESHFORGE_FAILED", subject=failed)
        await conn.close()


async def _count(conn: Connection, agent: str, n: int, exclude: set[int] | None = None) -> bool:
    letters = await dead_letters_of(conn, agent)
    return len([m for m in letters if m.seq not in (exclude or set())]) == n
