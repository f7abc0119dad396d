"""The transactional outbox: messages written with the caller's data, published by a relay.

A producer adds messages to the outbox inside its own store transaction (``enqueue``),
so they exist if and only if its other writes commit. ``OutboxRelay`` claims due rows
(leased, so several relays can run side by side), publishes them in id order with the
row's ``msg_id`` as ``Nats-Msg-Id``, marks them sent, and backs off on failure. A relay
killed after publishing but before marking re-publishes those rows on restart; the
server's duplicate window stores them once.

Example::

    with store.transaction() as tx:
        tx.execute("UPDATE stock SET qty = qty - 1 WHERE sku = ?", ("A-1",))
        enqueue(tx, "evt.default.demo.inventory.reserved", Envelope.new("inventory.reserved", {...}))

    relay = OutboxRelay(store, Publisher(conn.js))
    task = asyncio.create_task(relay.run())
    ...
    await relay.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from meshforge.envelope import Envelope, Outbound
from meshforge.errors import PublishError, StoreError
from meshforge.ops.faults import crash_point
from meshforge.ops.observability import Metrics
from meshforge.ops.retention import cleanup_once
from meshforge.publish.publisher import Publisher, PublishResult
from meshforge.store.base import OutboxMessage, OutboxRow, Store, Transaction
from meshforge.topology.subjects import validate_subject

__all__ = ["OutboxRelay", "enqueue", "enqueue_many"]

log = logging.getLogger("meshforge.outbox")

_IDLE_START = 0.05
_DEPTH_EVERY = 1.0


def enqueue(tx: Transaction, subject: str, envelope: Envelope) -> int:
    """Add ``envelope`` to the outbox inside the caller's transaction; returns the row id.

    The subject is checked now (an ``InvalidSubject`` here spoils nothing but this call),
    so a bad subject never sits in the outbox.

    Example::

        with store.transaction() as tx:
            enqueue(tx, "evt.default.demo.order.created", env)
    """
    validate_subject(subject)
    return tx.outbox_add(
        msg_id=envelope.id, subject=subject, data=envelope.encode(), headers=envelope.headers()
    )


def enqueue_many(tx: Transaction, messages: Iterable[tuple[str, Envelope]]) -> list[int]:
    """Add many ``(subject, envelope)`` messages in one statement; returns their row ids.

    Every subject is checked before anything is added.

    Example::

        with store.transaction() as tx:
            enqueue_many(tx, [("evt.default.demo.order.created", env) for env in envs])
    """
    rows = []
    checked: set[str] = set()
    for subject, envelope in messages:
        if subject not in checked:
            validate_subject(subject)
            checked.add(subject)
        rows.append(OutboxMessage(envelope.id, subject, envelope.encode(), envelope.headers()))
    return tx.outbox_add_many(rows)


class OutboxRelay:
    """Publishes outbox rows until ``stop()``; ``run_once()`` does one batch.

    ``lease_seconds`` is how long a claimed batch is this relay's before another relay may
    take it over (keep it well above the time a batch needs to publish). Failed rows are
    retried after an exponential backoff (``retry_base`` doubling up to ``retry_cap``, with
    jitter); a permanent error (permission denied, payload too large, ...) or
    ``max_attempts`` failures give the row up. Sent rows are deleted after ``retention``.

    Rows are published in id order; only a row that failed and is retried later can land
    after rows enqueued behind it. ``max_in_flight=1`` keeps strict order at a cost.
    """

    def __init__(
        self,
        store: Store,
        publisher: Publisher,
        *,
        relay_id: str | None = None,
        batch_size: int = 500,
        lease_seconds: float = 30.0,
        idle: float = 1.0,
        retention: float | None = None,
        metrics: Metrics | None = None,
        max_in_flight: int = 256,
        retry_base: float = 1.0,
        retry_cap: float = 60.0,
        max_attempts: int | None = None,
        cleanup_every: float = 60.0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
        self.store = store
        self.publisher = publisher
        self.relay_id = relay_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.batch_size = batch_size
        self.lease_seconds = lease_seconds
        self.idle = max(idle, _IDLE_START)
        self.retention = publisher.settings.outbox_retention if retention is None else retention
        self.metrics = metrics if metrics is not None else publisher.metrics
        self.max_in_flight = max_in_flight
        self.retry_base = retry_base
        self.retry_cap = retry_cap
        self.max_attempts = max_attempts
        self.cleanup_every = cleanup_every
        self.sent_total = 0
        self.pause = 0.0  # the current idle pause, for tests and health reports
        self._claimed = 0
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self._done = asyncio.Event()
        self._done.set()
        self._next_depth = 0.0
        self._next_cleanup = 0.0
        self._unmarked: list[int] = []  # published, not yet marked sent

    # ------------------------------------------------------------------ control
    def notify(self) -> None:
        """Wake an idle relay now (e.g. right after a transaction that enqueued rows)."""
        self._wake.set()

    async def stop(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Finish the batch in hand, then make ``run()`` return (waits up to ``timeout``)."""
        self._stopping.set()
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._done.wait(), timeout)

    async def run(self) -> None:
        """Publish due rows until ``stop()``; idle with backoff (up to ``idle`` s) when none.

        While a full batch is published the next is claimed in the store thread, in the
        same transaction that marks the batch before sent, so the store and the network
        work side by side at one commit a batch; after a smaller batch the claim that
        marks it comes right after it. A claimed batch is always published, also when
        ``stop()`` comes meanwhile.
        """
        if not self._done.is_set():
            raise RuntimeError(f"outbox relay {self.relay_id} is already running")
        self._stopping.clear()
        self._done.clear()
        self.pause = pause = _IDLE_START
        self._next_cleanup = time.monotonic()
        ahead: asyncio.Future[list[OutboxRow]] | None = None
        log.info("outbox relay %s started", self.relay_id)
        try:
            while not self._stopping.is_set() or ahead is not None:
                self._wake.clear()  # a notify() from here on ends the coming pause
                claiming, ahead = ahead if ahead is not None else self._claim(), None
                try:
                    rows = await claiming
                    self._claimed = len(rows)
                    more = not self._stopping.is_set()
                    if more and len(rows) >= self.batch_size:
                        ahead = self._claim()  # more are probably due: claim them meanwhile
                    # The rows sent are marked by the next claim, in its transaction.
                    await self._deliver(rows, defer=more)
                    if ahead is None and self._unmarked and not self._stopping.is_set():
                        ahead = self._claim()
                    await self._housekeeping(caught_up=ahead is None)
                except StoreError as exc:
                    if exc.kind == "closed":
                        raise
                    log.warning("outbox relay %s: %s; retrying in %.2fs", self.relay_id, exc, pause)
                    self._claimed = 0
                if ahead is not None or self._stopping.is_set():
                    pause = _IDLE_START
                    continue
                if self._claimed:
                    pause = _IDLE_START
                self.pause = pause
                woken = await self._idle(pause)
                pause = _IDLE_START if woken else min(pause * 2, self.idle)
            try:
                await self._flush_marks()  # left by a store error just before stop()
            except StoreError as exc:
                log.warning("outbox relay %s: %s", self.relay_id, exc)
        finally:
            if ahead is not None:  # only when run() itself was cancelled or failed
                ahead.cancel()
            self._done.set()
            log.info("outbox relay %s stopped (%d rows sent)", self.relay_id, self.sent_total)

    async def _idle(self, seconds: float) -> bool:
        """Pause up to ``seconds``; True when ``notify()`` or ``stop()`` ended it early."""
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            return False
        return True

    # ------------------------------------------------------------------ one batch
    async def run_once(self) -> int:
        """Claim up to ``batch_size`` due rows, publish them, record the outcome; returns rows sent."""
        rows = await self._claim()
        self._claimed = len(rows)
        return await self._deliver(rows)

    def _claim(self) -> asyncio.Future[list[OutboxRow]]:
        """Claim the next batch in the store thread; the rows published since the last
        mark are marked sent in the same transaction."""
        marks, self._unmarked = self._unmarked, []
        return asyncio.ensure_future(self._claim_marking(marks))

    async def _claim_marking(self, marks: list[int]) -> list[OutboxRow]:
        try:
            rows = await asyncio.to_thread(
                self.store.outbox_claim, self.relay_id, self.batch_size, self.lease_seconds,
                mark_sent=marks,
            )  # fmt: skip
        except BaseException:
            self._unmarked = marks + self._unmarked  # marked with the next claim or flush
            raise
        self.sent_total += len(marks)
        return rows

    async def _deliver(self, rows: list[OutboxRow], *, defer: bool = False) -> int:
        """Publish claimed rows and record the outcome; returns rows sent.

        With ``defer`` the rows sent are marked by the next ``_claim`` (or
        ``_flush_marks``), in its transaction, instead of one of their own now.
        """
        if not rows:
            return 0
        started = time.monotonic()
        items = [Outbound(r.subject, r.data, r.headers, r.msg_id) for r in rows]
        outcomes = await self.publisher.publish_each(items, max_in_flight=self.max_in_flight)
        crash_point("after_publish")
        elapsed = time.monotonic() - started
        if elapsed > self.lease_seconds:
            log.warning(
                "outbox relay %s: a batch took %.1fs, longer than the %.1fs lease; another "
                "relay may have published it too (the server drops the duplicates)",
                self.relay_id, elapsed, self.lease_seconds,
            )  # fmt: skip
        sent = [
            row.id
            for row, out in zip(rows, outcomes, strict=True)
            if isinstance(out, PublishResult)
        ]
        self._unmarked += sent
        if not defer:
            await self._flush_marks()
        for row, out in zip(rows, outcomes, strict=True):
            if isinstance(out, PublishError):
                await self._failed(row, out)
        return len(sent)

    async def _flush_marks(self) -> None:
        """Mark the rows published since the last mark sent (a store error is raised here)."""
        marks, self._unmarked = self._unmarked, []
        if not marks:
            return
        try:
            await asyncio.to_thread(self.store.outbox_mark_sent, marks)
        except BaseException:
            self._unmarked = marks + self._unmarked
            raise
        self.sent_total += len(marks)

    async def _failed(self, row: OutboxRow, err: PublishError) -> None:
        attempts = row.attempts + 1
        give_up = not err.retriable or (
            self.max_attempts is not None and attempts >= self.max_attempts
        )
        delay = random.uniform(0.5, 1.0) * min(
            self.retry_cap, self.retry_base * 2 ** (attempts - 1)
        )
        retry_at = datetime.now(UTC) + timedelta(seconds=delay)
        await asyncio.to_thread(
            self.store.outbox_mark_failed, row.id, str(err), retry_at, give_up=give_up
        )
        if give_up:
            log.error(
                "outbox row %d (msg id %s) given up after %d attempt(s): %s",
                row.id,
                row.msg_id,
                attempts,
                err,
            )
        else:
            log.warning(
                "outbox row %d (msg id %s) failed, retry in %.1fs: %s",
                row.id,
                row.msg_id,
                delay,
                err,
            )

    async def _housekeeping(self, *, caught_up: bool = True) -> None:
        now = time.monotonic()
        if now >= self._next_depth:
            self._next_depth = now + _DEPTH_EVERY
            depth = await asyncio.to_thread(self.store.outbox_depth)
            self.metrics.outbox_depth.set(depth)
        # A due cleanup waits until the relay has caught up (every row sent is marked by
        # then), but never longer than another ``cleanup_every``.
        due = self._next_cleanup
        if now >= due and (caught_up or now >= due + self.cleanup_every):
            self._next_cleanup = now + self.cleanup_every
            await cleanup_once(
                f"outbox relay {self.relay_id}", self.store.outbox_cleanup, self.retention
            )

    async def depth(self) -> int:
        """Rows still to publish (also sets the ``outbox_depth`` gauge)."""
        value = await asyncio.to_thread(self.store.outbox_depth)
        self.metrics.outbox_depth.set(value)
        return value
