"""Published marks: which effects' outputs reached the stream, noted in the store for the
audit (``published_at``; the exactly-once protocol itself never reads it).

The engine takes the waiting marks into each group's transaction (``take``), so marking
costs no transaction of its own under load. Only when no group comes for ``idle``
seconds does ``flush`` (the engine's: one small transaction under its commit lock) run.

Example (what ``Engine`` does)::

    marks = PublishedMarks(flush, idle=1.0)
    marks.add([(scope, key)])          # after the outputs were published
    batch_marks = marks.take()         # into the next transaction
    marks.done(batch_marks, error)     # after it: error None, or what failed it
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from meshforge.errors import StoreError
from meshforge.topology.scope import Scope

__all__ = ["PublishedMarks"]

log = logging.getLogger("meshforge.engine")

Mark = tuple[Scope, str]


class PublishedMarks:
    """The marks waiting for a transaction, and the idle flush that catches the last ones."""

    def __init__(self, flush: Callable[[], Awaitable[None]], *, idle: float = 1.0) -> None:
        self._flush = flush
        self.idle = idle
        self._waiting: list[Mark] = []
        self._commits = 0
        self._flusher: asyncio.Task[None] | None = None
        self._closed = False

    def add(self, marks: Sequence[Mark]) -> None:
        """Outputs of these keys went out; note them with the next transaction."""
        self._waiting += marks
        self._schedule()

    def take(self) -> list[Mark]:
        """Every mark waiting, for the transaction about to run."""
        marks, self._waiting = self._waiting, []
        return marks

    def done(self, marks: list[Mark], error: BaseException | None, *, retry: bool = False) -> None:
        """A transaction that took ``marks`` ended; on a ``retry``-able error they wait again,
        on another they are dropped (they may be what failed it)."""
        self._commits += 1
        if error is None:
            return
        if retry:
            self._waiting = marks + self._waiting
        elif marks:
            log.debug("%d published marks dropped with a failed transaction", len(marks))

    def close(self) -> None:
        self._closed = True
        if self._flusher is not None:
            self._flusher.cancel()

    def _schedule(self) -> None:
        if self._flusher is None and not self._closed and self._waiting:
            self._flusher = asyncio.ensure_future(self._when_idle(self._commits))

    async def _when_idle(self, commits: int) -> None:
        try:
            while True:
                await asyncio.sleep(self.idle)
                if self._commits == commits or not self._waiting:
                    break
                commits = self._commits
            if self._waiting and not self._closed:
                await self._flush()
        except (StoreError, RuntimeError) as exc:  # an audit aid only; RuntimeError: closed
            log.debug("published marks not stored: %s", exc)
        finally:
            self._flusher = None
            self._schedule()
