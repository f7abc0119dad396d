"""Deleting store rows that have aged out: one loop for every kind of row that does.

Each kind of row has its own ``*_cleanup(older_than)`` method on the store; these run
one of them now, or every ``interval`` seconds until told to stop. ``store_retention``
is the worker's loop over effects (with their outputs) and inbox rows.

Example::

    stop = asyncio.Event()
    task = asyncio.create_task(cleanup_loop("node replies", store.node_replies_cleanup, 7 * 86400, stop=stop))
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from meshforge.errors import StoreError, one_line
from meshforge.store.base import Store

__all__ = ["cleanup_loop", "cleanup_once", "store_retention"]

log = logging.getLogger("meshforge.retention")


async def cleanup_once(what: str, delete: Callable[[datetime], int], retention: float) -> int:
    """Delete the rows ``delete`` finds older than ``retention`` seconds; how many."""
    cutoff = datetime.now(UTC) - timedelta(seconds=retention)
    removed = await asyncio.to_thread(delete, cutoff)
    if removed:
        log.info("%s cleanup removed %d row(s) older than %.0fs", what, removed, retention)
    return removed


async def cleanup_loop(
    what: str,
    delete: Callable[[datetime], int],
    retention: float,
    *,
    interval: float = 3600.0,
    stop: asyncio.Event | None = None,
) -> None:
    """``cleanup_once`` now and every ``interval`` seconds until ``stop`` is set (or the
    task is cancelled). Store errors are logged and tried again next time."""
    stop = stop or asyncio.Event()
    while not stop.is_set():
        try:
            await cleanup_once(what, delete, retention)
        except StoreError as exc:
            log.warning("%s cleanup failed: %s", what, one_line(exc))
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            continue


async def store_retention(
    store: Store,
    *,
    effect_retention: float,
    inbox_retention: float,
    interval: float = 3600.0,
    stop: asyncio.Event | None = None,
) -> None:
    """Keep the store bounded: delete aged inbox rows, then aged effects with their outputs,
    now and every ``interval`` seconds until ``stop`` is set (or the task is cancelled).

    A retention of 0 keeps those rows forever. Inbox rows go first, so an audit never sees
    a processed inbox row whose effect is already gone. The first pass runs even when
    ``stop`` is already set (one pass: ``store_retention(..., stop=set_event)``).
    """
    stop = stop or asyncio.Event()
    while True:
        for what, delete, retention in (
            ("inbox", store.inbox_cleanup, inbox_retention),
            ("effects", store.effects_cleanup, effect_retention),
        ):
            if retention <= 0:
                continue
            try:
                await cleanup_once(what, delete, retention)
            except StoreError as exc:
                log.warning("%s cleanup failed: %s", what, one_line(exc))
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            continue
