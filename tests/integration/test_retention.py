"""A running worker keeps its store bounded: effects past their retention are deleted,
recent ones still answer a resent command."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from test_engine_support import (
    SCOPE,
    consumer_idle,
    ledger_agent,
    open_conn,
    open_store_async,
    running,
    send,
    send_many,
    settings_for,
    wait_until,
)

from meshforge.config import load_settings
from meshforge.envelope import Envelope
from meshforge.errors import ConfigError
from meshforge.store import open_store


async def test_worker_deletes_old_effects_and_recent_ones_still_dedupe(
    nats_url: str, sqlite_url: str
) -> None:
    agent = ledger_agent()
    consumer = f"{agent.name}_consumer"
    subject = f"cmd.default.test.{agent.name}.credit"
    # An effect stored eight days ago, as an earlier run of the worker left it.
    old = Envelope.new(f"{agent.name}.credit", {"account": "old", "amount": 5}, source="test")
    past = await asyncio.to_thread(
        open_store, sqlite_url, clock=lambda: datetime.now(UTC) - timedelta(days=8)
    )
    with past.transaction() as tx:
        tx.effect_put(consumer, old.key, old.id, [], scope=SCOPE)
    past.close()

    settings = settings_for(nats_url, sqlite_url, effect_retention="1d", retention_interval="1s")
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)

    async def keys() -> set[str]:
        return {e.key for e in await asyncio.to_thread(lambda: list(store.effects_read(consumer)))}

    async def gone() -> bool:
        return old.key not in await keys()

    try:
        async with running([agent], settings, store=store):
            await wait_until(gone, what="the eight-day-old effect deleted")
            recent = await send(conn, agent.name, "credit", {"account": "a", "amount": 3})
            await wait_until(lambda: consumer_idle(conn, agent.name))
            # The same key again under a new message id: answered from the stored effect.
            await send_many(conn, [(subject, recent.with_(id="resend-" + recent.id))])
            await wait_until(lambda: consumer_idle(conn, agent.name))
            # The old command again: its effect is gone, so it runs (retention is the limit).
            await send_many(conn, [(subject, old)])
            await wait_until(lambda: consumer_idle(conn, agent.name))
            assert await keys() == {recent.key, old.key}
        ran = [cmd_id for cmd_id, _ in agent.calls]  # type: ignore[attr-defined]
        assert ran == [recent.id, old.id]
        assert len(list(store.events_read(agent.name, scope=SCOPE))) == 2
    finally:
        store.close()
        await conn.close()


def test_effect_retention_shorter_than_the_duplicate_window_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"effect_retention: expected 0 \(keep forever\) or at least 196s"
    ):
        load_settings({"effect_retention": "60s", "duplicate_window": "2m"}, env={})
    assert load_settings({"effect_retention": 0}, env={}).effect_retention == 0
    assert load_settings(env={}).effect_retention == 7 * 86400
