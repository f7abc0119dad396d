"""Conformance: the worker's retention pass keeps the store bounded, on both backends."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from meshforge.errors import StoreError
from meshforge.ops.retention import store_retention
from meshforge.store import Store, StoredOutput

if TYPE_CHECKING:
    from conftest import ManualClock

WEEK = 7 * 86400.0


def handled(store: Store, key: str, *, done: bool = True) -> None:
    """One command as the engine and the inbox leave it: an inbox row, an effect, two outputs."""
    with store.transaction() as tx:
        tx.inbox_begin(
            key, "c", message_id=key, type="t", subject="cmd.default.demo.a.b", stream=None,
            stream_seq=None, deliveries=1, headers={},
        )  # fmt: skip
        if done:
            tx.inbox_done(key, "c")
        outputs = [
            StoredOutput(p, "evt.default.demo.a.done", f"{key}-{p}", b"x" * 64, {}) for p in (0, 1)
        ]
        tx.effect_put("c", key, key, outputs)


def outputs_left(store: Store) -> int:
    return sum(len(e.outputs) for e in store.effects_read())


def run_once(store: Store, effect: float, inbox: float) -> None:
    stop = asyncio.Event()
    stop.set()  # one pass
    asyncio.run(store_retention(store, effect_retention=effect, inbox_retention=inbox, stop=stop))


def test_old_effects_outputs_and_inbox_rows_go_recent_and_in_flight_stay(
    store: Store, clock: ManualClock
) -> None:
    clock.now = datetime.now(UTC) - timedelta(days=8)
    handled(store, "old")
    handled(store, "old-in-flight", done=False)
    clock.now = datetime.now(UTC) - timedelta(hours=1)
    handled(store, "recent")
    run_once(store, WEEK, WEEK)
    assert [e.key for e in store.effects_read()] == ["recent"]
    assert [len(e.outputs) for e in store.effects_read()] == [2]
    assert outputs_left(store) == 2
    assert sorted(r.key for r in store.inbox_read()) == ["old-in-flight", "recent"]


def test_zero_retention_keeps_rows_forever(store: Store, clock: ManualClock) -> None:
    clock.now = datetime.now(UTC) - timedelta(days=400)
    handled(store, "ancient")
    run_once(store, 0, 0)
    assert [e.key for e in store.effects_read()] == ["ancient"]
    assert outputs_left(store) == 2
    assert [r.key for r in store.inbox_read()] == ["ancient"]


def test_a_store_error_is_logged_and_the_loop_goes_on(store: Store, clock: ManualClock) -> None:
    clock.now = datetime.now(UTC) - timedelta(days=8)
    handled(store, "old")
    calls = []
    real = store.inbox_cleanup

    def failing(older_than: datetime) -> int:
        calls.append(older_than)
        raise StoreError("disk I/O error", kind="error")

    store.inbox_cleanup = failing  # type: ignore[method-assign]
    try:
        run_once(store, WEEK, WEEK)
    finally:
        store.inbox_cleanup = real  # type: ignore[method-assign]
    assert len(calls) == 1
    assert list(store.effects_read()) == []  # the effects pass still ran
