"""The inbox: each message's effect happens once per consumer, with the handler's own writes.

``with_inbox`` wraps a handler that takes ``(delivery, tx)`` into a consumer handler. In
ONE store transaction it records the message in the inbox keyed by (idempotency key,
consumer), runs the handler with that transaction (its own table writes join it), marks
the message processed and commits; the consumer acks after. A redelivery (or the same
request sent again with the same ``Idempotency-Key``) finds the key processed: it is
acked without running the handler and counted in ``duplicates_skipped``.

A handler that raises rolls its writes back; the failure is recorded (status ``failed``,
the error) in a separate transaction and the consumer's rules decide (nak with backoff,
dead letter, ...). A handler that returns a decision other than ack also rolls back.

Sync handlers run in a worker thread with a ``Transaction``; async handlers get an
``AsyncTransaction`` whose methods are awaited (they run on a thread of their own).

Example::

    def credit(delivery: Delivery, tx: Transaction) -> None:
        p = delivery.envelope.payload
        tx.execute("UPDATE accounts SET balance = balance + ? WHERE id = ?", (p["amount"], p["id"]))

    store = open_store(settings.store_url)
    consumer = Consumer(conn, spec, handler=with_inbox(store, spec.durable, credit))
    cleanup = asyncio.create_task(inbox_cleanup(store, settings.inbox_retention))
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from meshforge.consume.decisions import Action, Decision, Delivery, Handler
from meshforge.envelope import H_MSG_ID
from meshforge.errors import StoreError, one_line
from meshforge.ops.observability import Metrics
from meshforge.ops.retention import cleanup_loop, cleanup_once
from meshforge.store.base import InboxRecord, Store, Transaction
from meshforge.topology.scope import command_scope

__all__ = [
    "AsyncInboxHandler",
    "AsyncTransaction",
    "InboxHandler",
    "SyncInboxHandler",
    "cleanup_inbox_once",
    "inbox_cleanup",
    "with_inbox",
]

log = logging.getLogger("meshforge.inbox")

T = TypeVar("T")

SyncInboxHandler = Callable[[Delivery, Transaction], Decision | None]
AsyncInboxHandler = Callable[[Delivery, "AsyncTransaction"], Awaitable[Decision | None]]
InboxHandler = SyncInboxHandler | AsyncInboxHandler


class AsyncTransaction:
    """A ``Transaction`` for async handlers: every method is awaited and runs on the
    transaction's own thread (the store's API is blocking).

    Example: ``rows = await tx.execute("SELECT qty FROM stock WHERE sku = ?", ("A1",))``
    """

    def __init__(self, tx: Transaction, call: Callable[..., Awaitable[Any]]) -> None:
        self._tx = tx
        self._call = call

    async def execute(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        """Run SQL (``?`` placeholders) in the transaction; returns the rows."""
        rows: list[tuple[Any, ...]] = await self._call(self._tx.execute, sql, params)
        return rows

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self._tx, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._call(functools.partial(method, *args, **kwargs))

        return call


class _Skip:
    """The key was processed before: ack without running the handler."""


_SKIP = _Skip()


class _Undo(Exception):
    """Roll the transaction back and return ``decision``."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.action.value)
        self.decision = decision


def _begin_fields(delivery: Delivery) -> dict[str, Any]:
    env = delivery.envelope
    return {
        "message_id": env.id if env is not None else delivery.headers.get(H_MSG_ID),
        "type": env.type if env is not None else None,
        "subject": delivery.subject,
        "stream": delivery.stream,
        "stream_seq": delivery.seq,
        "deliveries": delivery.num_delivered,
        "headers": dict(delivery.headers),
        "resource_type": env.resource_type if env is not None else None,
        "resource_id": env.resource_id if env is not None else None,
        # The subject's tenant and namespace: two tenants' keys never meet.
        "scope": command_scope(delivery.subject, env.tenant_id if env is not None else None),
    }


def _is_async(handler: object) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004  # callable objects too
    )


def with_inbox(
    store: Store,
    consumer: str,
    handler: InboxHandler,
    *,
    metrics: Metrics | None = None,
    attempts: int = 5,
) -> Handler:
    """A consumer handler running ``handler(delivery, tx)`` at most once per
    (idempotency key, ``consumer``), in one transaction with the inbox record.

    Store errors that may pass on a second try (busy, serialisation conflict) rerun the
    whole transaction up to ``attempts`` times. See the module docstring for an example.
    """
    skipped = (metrics or Metrics.default()).duplicates_skipped.labels(consumer=consumer)
    run_async = _is_async(handler)

    async def handle(delivery: Delivery) -> Decision | None:
        key = delivery.key
        fields = _begin_fields(delivery)
        try:
            if run_async:
                outcome = await _run_async(
                    store,
                    key,
                    consumer,
                    fields,
                    delivery,
                    cast(AsyncInboxHandler, handler),
                    attempts,
                )
            else:
                outcome = await asyncio.to_thread(
                    _run_sync,
                    store,
                    key,
                    consumer,
                    fields,
                    delivery,
                    cast(SyncInboxHandler, handler),
                    attempts,
                )
        except _Undo as undo:
            if undo.decision.action in (Action.DEAD_LETTER, Action.TERM):
                reason = undo.decision.reason or undo.decision.action.value
                await _record_failure(
                    store, key, consumer, fields, f"{reason}: {undo.decision.error}"
                )
            return undo.decision
        except Exception as exc:
            await _record_failure(store, key, consumer, fields, one_line(exc))
            raise
        if outcome is _SKIP:
            skipped.inc()
            log.info(
                "%s already processed %s (key %s): acked without running the handler",
                consumer,
                delivery.subject,
                key,
                extra={"consumer": consumer, "key": key, "stream_seq": delivery.seq},
            )
            return Decision.ack()
        return cast(Decision | None, outcome)

    return handle


def _run_sync(
    store: Store,
    key: str,
    consumer: str,
    fields: dict[str, Any],
    delivery: Delivery,
    handler: SyncInboxHandler,
    attempts: int,
) -> Decision | _Skip | None:
    def work(tx: Transaction) -> Decision | _Skip | None:
        if tx.inbox_begin(key, consumer, **fields).processed:
            return _SKIP
        decision = handler(delivery, tx)
        if decision is not None and decision.action is not Action.ACK:
            raise _Undo(decision)
        tx.inbox_done(key, consumer, scope=fields["scope"])
        return decision

    return store.run(work, attempts=attempts)


async def _run_async(
    store: Store,
    key: str,
    consumer: str,
    fields: dict[str, Any],
    delivery: Delivery,
    handler: AsyncInboxHandler,
    attempts: int,
) -> Decision | _Skip | None:
    for attempt in range(1, attempts + 1):
        try:
            return await _async_transaction(store, key, consumer, fields, delivery, handler)
        except StoreError as exc:
            if not exc.retriable or attempt >= attempts:
                raise
    raise AssertionError("unreachable")


async def _async_transaction(
    store: Store,
    key: str,
    consumer: str,
    fields: dict[str, Any],
    delivery: Delivery,
    handler: AsyncInboxHandler,
) -> Decision | _Skip | None:
    # One thread per transaction: it opens, uses and closes it, whatever the handler awaits.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshforge-inbox")
    loop = asyncio.get_running_loop()

    def call(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        return loop.run_in_executor(executor, fn, *args)

    try:
        manager = store.transaction()
        tx: Transaction = await call(manager.__enter__)
        atx = AsyncTransaction(tx, call)
        try:
            record: InboxRecord = await atx.inbox_begin(key, consumer, **fields)
            if record.processed:
                result: Decision | _Skip | None = _SKIP
            else:
                result = await handler(delivery, atx)
                if result is not None and result.action is not Action.ACK:
                    raise _Undo(result)
                await atx.inbox_done(key, consumer, scope=fields["scope"])
        except BaseException as exc:
            await asyncio.shield(call(manager.__exit__, type(exc), exc, exc.__traceback__))
            raise
        await asyncio.shield(call(manager.__exit__, None, None, None))
        return result
    finally:
        executor.shutdown(wait=False)


async def _record_failure(
    store: Store, key: str, consumer: str, fields: dict[str, Any], error: str
) -> None:
    """Note the failure in its own transaction; a store failure here is only logged."""

    def work(tx: Transaction) -> None:
        if tx.inbox_begin(key, consumer, **fields).processed:
            return  # another delivery finished it meanwhile
        tx.inbox_failed(key, consumer, error, scope=fields["scope"])

    try:
        await asyncio.to_thread(store.run, work)
    except Exception as exc:  # the consumer's decision matters more than this record
        log.warning("%s: could not record the failure of key %s: %s", consumer, key, one_line(exc))


async def cleanup_inbox_once(store: Store, retention: float) -> int:
    """Delete processed and failed inbox rows untouched for ``retention`` seconds; how many."""
    return await cleanup_once("inbox", store.inbox_cleanup, retention)


async def inbox_cleanup(
    store: Store,
    retention: float,
    *,
    interval: float = 3600.0,
    stop: asyncio.Event | None = None,
) -> None:
    """Run ``cleanup_inbox_once`` every ``interval`` seconds until ``stop`` is set (or the
    task is cancelled). Store errors are logged and tried again next time.

    Example: ``asyncio.create_task(inbox_cleanup(store, settings.inbox_retention))``
    """
    await cleanup_loop("inbox", store.inbox_cleanup, retention, interval=interval, stop=stop)
