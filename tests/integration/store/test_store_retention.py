"""Conformance: the worker's retention pass keeps the store bounded, on both backends."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from meshforge.errors import StoreError
from meshforge.ops.retention import store_retention
from meshforge.store import Store, StoredOutput

if TYPE_CHECKING:
    from collections.abc import Callable

    import pytest

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


def test_a_store_error_is_logged_and_the_loop_goes_on(
    store: Store, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="meshforge.retention")
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
    assert [
        (r.name, r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "meshforge.retention"
    ] == [
        ("meshforge.retention", logging.WARNING, "inbox cleanup failed: StoreError: disk I/O error")
    ]
    assert list(store.effects_read()) == []  # the effects pass still ran


def test_inbox_rows_are_deleted_before_effects(store: Store, clock: ManualClock) -> None:
    # docs/OPERATIONS.md: an audit must never see a processed inbox row whose effect is gone
    clock.now = datetime.now(UTC) - timedelta(days=8)
    handled(store, "old")
    seen: list[tuple[str, list[str], list[str]]] = []
    real_inbox, real_effects = store.inbox_cleanup, store.effects_cleanup

    def watched(what: str, delete: Callable[[datetime], int]) -> Callable[[datetime], int]:
        def run(older_than: datetime) -> int:
            removed = delete(older_than)
            inbox = [r.key for r in store.inbox_read()]
            effects = [e.key for e in store.effects_read()]
            seen.append((what, inbox, effects))
            return removed

        return run

    store.inbox_cleanup = watched("inbox", real_inbox)  # type: ignore[method-assign]
    store.effects_cleanup = watched("effects", real_effects)  # type: ignore[method-assign]
    try:
        run_once(store, WEEK, WEEK)
    finally:
        store.inbox_cleanup, store.effects_cleanup = real_inbox, real_effects  # type: ignore[method-assign]
    # after the first delete the inbox row is gone and its effect is still there
    assert seen == [("inbox", [], ["old"]), ("effects", [], [])]
