"""The effect loop against a real nats-server and real stores: outputs, duplicates, order, hash."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_engine_support import (
    SCOPE,
    Account,
    Tap,
    consumer_idle,
    events_of,
    ledger_agent,
    open_conn,
    open_store_async,
    running,
    send,
    send_many,
    settings_for,
    wait_until,
)

from meshforge.envelope import H_MSG_ID, Envelope, decode, derive_id, format_traceparent
from meshforge.ops.observability import Metrics
from meshforge.runtime.replay import replay, state_hash
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.server import EmbeddedServer


async def stored_commands(js: Any, subject: str) -> list[Envelope]:
    """Commands waiting in the work-queue stream on ``subject`` (read by sequence, not consumed)."""
    out: list[Envelope] = []
    seq = 1
    while True:
        try:
            raw = await js.get_msg(STREAM_COMMANDS, seq, subject=subject, next=True)
        except Exception:  # no further message on the subject
            return out
        out.append(decode(raw.data or b"", dict(raw.headers or {})))
        seq = raw.seq + 1


async def test_command_gets_events_sends_state_and_trace(nats_url: str, sqlite_url: str) -> None:
    agent = ledger_agent()
    settings = settings_for(nats_url, sqlite_url)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    try:
        async with running([agent], settings, store=store):
            cmd = await send(conn, agent.name, "credit", {"account": "acc1", "amount": 5})
            await wait_until(lambda: consumer_idle(conn, agent.name), what="command processed")
        events = [m.envelope() for m in await events_of(conn, agent.name)]
        assert len(events) == 1
        event = events[0]
        assert event is not None
        assert event.id == derive_id(cmd.id, 0)
        assert event.type == f"{agent.name}.credited"
        assert event.causation_id == cmd.id and event.correlation_id == cmd.id
        assert event.trace_id == cmd.trace_id and event.span_id not in (None, cmd.span_id)
        assert event.ts == cmd.ts  # the command's logical time flows on
        assert event.payload == {"account": "acc1", "amount": 5, "balance": 5}
        assert event.resource_id == "acc1" and event.source == agent.name
        sent = await stored_commands(conn.js, f"cmd.default.test.{agent.name}x.notify")
        assert [s.id for s in sent] == [derive_id(cmd.id, 1)]
        assert sent[0].causation_id == cmd.id and sent[0].key == sent[0].id

        with store.transaction() as tx:
            state = msgspec.json.decode(
                tx.state_get(agent.name, "acc1", scope=SCOPE) or b"", type=Account
            )
            outputs = tx.effect_get(f"{agent.name}_consumer", cmd.key, scope=SCOPE)
        assert state == Account(balance=5, history=[5])
        assert outputs is not None and [o.msg_id for o in outputs] == [event.id, sent[0].id]
        logged = list(store.events_read(agent.name, scope=SCOPE))
        assert [(e.event_id, e.position, e.command_id, e.key) for e in logged] == [
            (event.id, 1, cmd.id, cmd.key)
        ]
    finally:
        store.close()
        await conn.close()


async def test_missing_ts_is_injected_from_the_stored_time(nats_url: str, sqlite_url: str) -> None:
    agent = ledger_agent()
    settings = settings_for(nats_url, sqlite_url)
    conn = await open_conn(settings)
    try:
        async with running([agent], settings):
            body = (
                b'{"type": "%s.credit", "payload": {"account": "a", "amount": 1}}'
                % agent.name.encode()
            )
            before = datetime.now(UTC)
            await conn.js.publish(f"cmd.default.test.{agent.name}.credit", body,
                                  headers={H_MSG_ID: "no-ts-1"})  # fmt: skip
            await wait_until(lambda: consumer_idle(conn, agent.name))

            async def published() -> bool:  # an idle consumer may still be ahead of the event
                return bool(await events_of(conn, agent.name))

            await wait_until(published, what="the event")
        event = (await events_of(conn, agent.name))[0].envelope()
        assert event is not None and event.causation_id == "no-ts-1"
        stamped = datetime.fromisoformat(event.ts)
        assert before - timedelta(seconds=1) <= stamped <= datetime.now(UTC)
    finally:
        await conn.close()


async def test_same_idempotency_key_republishes_same_ids_and_changes_nothing(
    nats_url: str, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="meshforge.engine")
    agent = ledger_agent()
    settings = settings_for(nats_url, sqlite_url)
    metrics = Metrics()
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    tap = await Tap.on(conn.nc, f"evt.*.*.{agent.name}.>")
    try:
        async with running([agent], settings, store=store, metrics=metrics):
            first = await send(conn, agent.name, "credit", {"account": "a", "amount": 3})
            await wait_until(lambda: consumer_idle(conn, agent.name))
            # A new message (new id, so the server does not drop it) with the same key.
            again = first.with_(id="resend-" + first.id)
            await send_many(conn, [(f"cmd.default.test.{agent.name}.credit", again)])
            await wait_until(lambda: consumer_idle(conn, agent.name))
            await wait_until(lambda: _true(len(tap.msgs) >= 2), what="re-published event")
        assert tap.ids() == [derive_id(first.id, 0)] * 2  # same event id, twice on the wire
        assert len(await events_of(conn, agent.name)) == 1  # stored once by the server
        assert len(list(store.events_read(agent.name, scope=SCOPE))) == 1
        with store.transaction() as tx:
            state = msgspec.json.decode(
                tx.state_get(agent.name, "a", scope=SCOPE) or b"", type=Account
            )
        assert state.balance == 3
        skipped = metrics.duplicates_skipped.labels(consumer=f"{agent.name}_consumer")._value.get()
        assert skipped == 1
        said = [
            r.getMessage()
            for r in caplog.records
            if r.getMessage().startswith("Duplicate detected")
        ]
        assert len(said) == 1 and first.key in said[0]  # seed 001's log line
    finally:
        store.close()
        await conn.close()


async def _true(value: bool) -> bool:
    return value


async def test_same_resource_commands_apply_in_stream_order(nats_url: str, sqlite_url: str) -> None:
    agent = ledger_agent()
    settings = settings_for(nats_url, sqlite_url, batch_size=64)
    conn = await open_conn(settings)
    try:
        subject = f"cmd.default.test.{agent.name}.credit"
        envs = [Envelope.new(f"{agent.name}.credit", {"account": f"acc{i % 3}", "amount": i + 1})
                for i in range(30)]  # fmt: skip
        await send_many(conn, [(subject, e) for e in envs])  # all waiting: one batch
        async with running([agent], settings):
            await wait_until(lambda: consumer_idle(conn, agent.name))
        events = [m.envelope() for m in await events_of(conn, agent.name)]
        balances: dict[str, list[int]] = {}
        for e in events:
            assert e is not None
            balances.setdefault(e.payload["account"], []).append(e.payload["balance"])
        for account in ("acc0", "acc1", "acc2"):
            amounts = [e.payload["amount"] for e in envs if e.payload["account"] == account]
            running_sum = [sum(amounts[: i + 1]) for i in range(len(amounts))]
            assert balances[account] == running_sum
    finally:
        await conn.close()


@pytest.mark.parametrize("store_kind", ["sqlite", "postgresql"])
async def test_state_hash_is_the_same_whatever_the_batch_size(
    tmp_path: Path, pg_database: str, store_kind: str
) -> None:
    name = f"hash{uuid.uuid4().hex[:6]}"
    envs = [Envelope.new(f"{name}.credit", {"account": f"acc{i % 7}", "amount": i % 5 + 1})
            for i in range(120)]  # fmt: skip
    hashes = []
    for run, batch in enumerate((1, 7, 64)):
        # The very same commands each run: a fresh server each time, or they would be dropped
        # as duplicates; a fresh store (PostgreSQL: a fresh agent name in the shared database).
        agent = ledger_agent(name if store_kind == "sqlite" else f"{name}r{run}")
        url = f"sqlite:///{tmp_path / f'run{run}.db'}" if store_kind == "sqlite" else pg_database
        with EmbeddedServer(store_dir=tmp_path / f"nats{run}") as server:
            settings = settings_for(server.url, url, batch_size=batch)
            conn = await open_conn(settings)
            store = await open_store_async(url)
            try:
                subject = f"cmd.default.test.{agent.name}.credit"
                await send_many(
                    conn, [(subject, e.with_(type=f"{agent.name}.credit")) for e in envs]
                )
                async with running([agent], settings, store=store):
                    await wait_until(lambda a=agent, c=conn: consumer_idle(c, a.name), within=60)  # type: ignore[misc]
                result = await asyncio.to_thread(replay, store, agent.name, agent)
                assert result.events == 120 and result.resources == 7 and result.consistent
                # The type names the agent: give every run the same one so they compare.
                events = [dataclasses.replace(e, type=e.type.replace(agent.name, name))
                          for e in store.events_read(agent.name, scope=SCOPE)]  # fmt: skip
                hashes.append(state_hash(events))
            finally:
                store.close()
                await conn.close()
    assert len(set(hashes)) == 1


def test_traceparent_of_output_is_child_of_command() -> None:
    cmd = Envelope.new("x.credit", {"account": "a", "amount": 1})
    child = cmd.child("x.credited", {}, 0)
    header = child.headers()["traceparent"]
    assert header.startswith(f"00-{cmd.trace_id}-") and header != format_traceparent(
        cmd.trace_id or "", cmd.span_id or ""
    )


async def test_published_marks_ride_in_later_transactions_or_land_when_idle(
    nats_url: str, sqlite_url: str
) -> None:
    agent = ledger_agent()
    settings = settings_for(nats_url, sqlite_url, batch_size=2)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    consumer = f"{agent.name}_consumer"

    async def all_marked() -> bool:
        effects = await asyncio.to_thread(lambda: list(store.effects_read(consumer)))
        return len(effects) == 6 and all(e.published_at is not None for e in effects)

    try:
        async with running([agent], settings, store=store):
            for i in range(6):
                await send(conn, agent.name, "credit", {"account": f"a{i % 2}", "amount": 1})
            await wait_until(lambda: consumer_idle(conn, agent.name))
            # The last group's marks have no later transaction to ride in: the idle flush notes them.
            await wait_until(all_marked, within=10, what="every effect marked published")
    finally:
        store.close()
        await conn.close()
