"""Deleting store rows that have aged out: one loop for every kind of row that does.

Each kind of row has its own ``*_cleanup(older_than)`` method on the store; these run
one of them now, or every ``interval`` seconds until told to stop.

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

__all__ = ["cleanup_loop", "cleanup_once"]

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
