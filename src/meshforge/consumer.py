"""The consumer: pull or push delivery, bounded concurrency, ack decisions, graceful stop.

A ``Consumer`` takes messages from a durable JetStream consumer and runs a handler for
each (or a batch handler per fetch). It never holds more messages than it can work on:
a pull asks for at most ``concurrency - in flight`` (a batch consumer: one batch of at
most ``batch_size`` at a time), a push consumer is capped by ``max_ack_pending``.
Malformed bodies and exhausted deliveries are dead-lettered without reaching the
handler; handler errors become decisions (see ``meshforge.decisions``); a handler that
runs long gets ``in_progress`` every third of the ack wait. ``stop()`` stops fetching,
lets in-flight work finish within ``shutdown_timeout``, naks the rest (no delay, so it is
redelivered promptly) and returns.

Example::

    async def handle(delivery: Delivery) -> Decision | None:
        print(delivery.envelope.type, delivery.envelope.payload)
        return None  # ack

    consumer = Consumer(conn, agent_consumer("order", settings), handler=handle,
                        settings=settings)
    consumer.install_signal_handlers()
    await consumer.run()   # until SIGINT/SIGTERM or consumer.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from nats.errors import MsgAlreadyAckdError
from nats.js.errors import NotFoundError

from meshforge.ack import Acker
from meshforge.config import Settings, load_settings
from meshforge.decisions import (
    REASON_MALFORMED,
    REASON_MAX_DELIVERIES,
    Action,
    BatchHandler,
    Decision,
    Delivery,
    Handler,
    Middleware,
    decide,
)
from meshforge.envelope import decode
from meshforge.errors import ConfigError, ConnectionFailed, MalformedMessage, MissingTopology
from meshforge.faults import crash_point
from meshforge.middleware import (
    chain,
    logging_middleware,
    metrics_middleware,
    timeout_middleware,
    tracing_middleware,
)
from meshforge.observability import Metrics
from meshforge.pull import PullSource
from meshforge.push import ensure_push_consumer

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from meshforge.connection import Connection
    from meshforge.publisher import Publisher
    from meshforge.topology import ConsumerSpec

__all__ = [
    "DEFAULT",
    "Action",
    "BatchHandler",
    "Consumer",
    "Decision",
    "Delivery",
    "Handler",
    "Middleware",
]

log = logging.getLogger("meshforge.consumer")


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


#: ``max_deliver`` default: one less than the consumer's MaxDeliver (the last delivery is
#: kept for dead-lettering), or ``settings.max_deliver`` when the server has no limit.
DEFAULT: Any = _Default()

_IDLE_MIN, _IDLE_MAX = 0.05, 1.0
_SILENT_REBUILD = 2  # silent pull requests in a row before the subscription is rebuilt
_STALL_CHECK = 10.0  # seconds of empty fetches between checks of the consumer's pending count


class Consumer:
    """Runs ``handler`` (or ``batch_handler``) for the messages of one durable consumer.

    ``spec`` is a ``ConsumerSpec`` (provisioned with ``topology.ensure`` when
    ``provision``, else checked with ``topology.verify``) or ``"STREAM/durable"`` for a
    consumer that exists already. See the module docstring for an example.
    """

    def __init__(
        self,
        conn: Connection,
        spec: ConsumerSpec | str,
        *,
        handler: Handler | None = None,
        batch_handler: BatchHandler | None = None,
        settings: Settings | None = None,
        mode: Literal["pull", "push"] = "pull",
        deliver_group: str | None = None,
        concurrency: int | None = None,
        batch_size: int | None = None,
        max_deliver: int | Any | None = DEFAULT,
        middlewares: Sequence[Middleware] = (),
        unrecoverable: tuple[type[BaseException], ...] = (),
        decode: bool = True,
        handler_timeout: float | None = None,
        metrics: Metrics | None = None,
        publisher: Publisher | None = None,
        provision: bool | None = None,
        ack_sync: bool = False,
    ) -> None:
        if (handler is None) == (batch_handler is None):
            raise ConfigError("consumer: give exactly one of handler= or batch_handler=")
        if mode not in ("pull", "push"):
            raise ConfigError(f"consumer mode: expected 'pull' or 'push', got {mode!r}")
        if batch_handler is not None and mode != "pull":
            raise ConfigError("consumer: a batch handler needs mode='pull'")
        self._conn = conn
        self.settings = settings if settings is not None else load_settings()
        if isinstance(spec, str):
            stream, sep, durable = spec.partition("/")
            if not sep or not stream or not durable:
                raise ConfigError(
                    f"consumer: expected a ConsumerSpec or 'STREAM/durable', got {spec!r}"
                )
            self.spec: ConsumerSpec | None = None
            self.stream, self.durable = stream, durable
        else:
            self.spec, self.stream, self.durable = spec, spec.stream, spec.durable
        self.mode = mode
        self.deliver_group = deliver_group or self.durable
        self.concurrency = concurrency or self.settings.concurrency
        self.batch_size = batch_size or self.settings.batch_size
        if self.concurrency < 1 or self.batch_size < 1:
            raise ConfigError("consumer: concurrency and batch_size must be >= 1")
        self._max_deliver_arg = max_deliver
        self.max_deliver: int | None = None
        self.unrecoverable = tuple(unrecoverable)
        self.decode = decode
        self.metrics = metrics or Metrics.default()
        self.provision = self.settings.provision if provision is None else provision
        self._handler = handler
        self._batch_handler = batch_handler
        self._handler_timeout = handler_timeout
        self._publisher = publisher
        self._ack_sync = ack_sync
        builtin: list[Middleware] = [
            tracing_middleware(self.durable),
            logging_middleware(),
            metrics_middleware(self.metrics, self.durable),
        ]
        inner = [timeout_middleware(handler_timeout)] if handler_timeout else []
        self._chain = chain([*builtin, *middlewares, *inner], handler) if handler else None
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._finished = asyncio.Event()
        self._freed = asyncio.Event()
        self._stop_timeout: float | None = None
        self._running = False
        self._tasks: dict[asyncio.Task[None], list[Msg]] = {}
        self._ack_wait = self.settings.ack_wait
        self._wait_backoff: tuple[float, ...] = ()
        self._server_max = -1
        self._deliver: tuple[str, str] = ("", "")
        self._acker: Acker | None = None
        self._source: PullSource | None = None
        self._push_sub: Subscription | None = None
        label = {"consumer": self.durable}
        self._consumed = self.metrics.consumed.labels(**label)
        self._redelivered = self.metrics.redeliveries.labels(**label)
        self._in_flight = self.metrics.in_flight.labels(**label)
        self._batch_seconds = self.metrics.handler_seconds.labels(**label)

    # ------------------------------------------------------------------ lifecycle
    @property
    def in_flight(self) -> int:
        """Messages being handled now."""
        return sum(len(msgs) for msgs in self._tasks.values())

    async def run(self) -> None:
        """Consume until ``stop()`` (or cancellation); then finish or nak in-flight work."""
        if self._running:
            raise RuntimeError(f"consumer {self.durable} is already running")
        self._running = True
        self._finished.clear()
        self._stop.clear()
        try:
            await self._prepare()
            if self.mode == "push":
                await self._run_push()
            else:
                await self._run_pull()
        finally:
            try:
                await asyncio.shield(self._shutdown())
            finally:
                self.ready.clear()
                self._running = False
                self._finished.set()

    async def stop(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Graceful stop: no more fetching; in-flight work gets ``timeout`` seconds
        (default ``settings.shutdown_timeout``), the rest is nak'ed; returns when done."""
        self._stop_timeout = timeout
        self._stop.set()
        if self._running:
            await self._finished.wait()

    def install_signal_handlers(self) -> None:
        """Make SIGINT and SIGTERM call ``stop()`` (on the running event loop)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.stop()))

    # ------------------------------------------------------------------ setup
    def _get_publisher(self) -> Publisher:
        if self._publisher is None:
            from meshforge.publisher import Publisher

            self._publisher = Publisher(self._conn.js, self.settings, self.metrics)
        return self._publisher

    async def _prepare(self) -> None:
        js = self._conn.js
        if self.spec is not None and self.mode == "pull":
            from meshforge import topology

            if self.provision:
                await topology.ensure(js, await self._missing_streams(), [self.spec])
            else:
                await topology.verify(js, [], [self.spec])
        elif self.spec is not None:
            missing = await self._missing_streams() if self.provision else []
            if missing:
                from meshforge import topology

                await topology.ensure(js, missing, [])
            self._deliver = await ensure_push_consumer(
                js,
                self.spec,
                group=self.deliver_group,
                max_ack_pending=self.concurrency,
                provision=self.provision,
            )
        try:
            info = await js.consumer_info(self.stream, self.durable)
        except NotFoundError:
            raise MissingTopology(
                f"missing JetStream topology: consumer {self.stream}/{self.durable}"
            ) from None
        if self.spec is None and self.mode == "push":
            self._deliver = (info.config.deliver_subject or "", info.config.deliver_group or "")
            if not self._deliver[0]:
                raise ConfigError(f"consumer {self.stream}/{self.durable} is not a push consumer")
        config = info.config
        self._ack_wait = float(config.ack_wait or self.settings.ack_wait)
        self._wait_backoff = tuple(config.backoff or ())
        server_max = self._server_max = config.max_deliver or -1
        if self._max_deliver_arg is DEFAULT:
            self.max_deliver = (
                max(1, server_max - 1) if server_max > 0 else self.settings.max_deliver
            )
        else:
            self.max_deliver = self._max_deliver_arg
        self._acker = Acker(
            self.durable,
            self.metrics,
            self._get_publisher,
            backoff=self._wait_backoff or self.settings.backoff,
            ack_sync=self._ack_sync,
        )

    async def _missing_streams(self) -> list[Any]:
        """The CONTRACT stream spec for our stream when it does not exist yet."""
        from meshforge.topology import default_streams

        wanted = [s for s in default_streams(self.settings) if s.name == self.stream]
        if not wanted:
            return []
        try:
            await self._conn.js.stream_info(self.stream)
        except NotFoundError:
            return wanted
        return []

    def _keepalive_period(self, num_delivered: int) -> float:
        """A third of the shortest time the server waits for this delivery's ack."""
        wait = self._ack_wait
        if self._wait_backoff:
            wait = min(wait, self._wait_backoff[min(num_delivered, len(self._wait_backoff)) - 1])
        return max(wait / 3, 0.01)

    # ------------------------------------------------------------------ pull
    async def _run_pull(self) -> None:
        source = self._source = PullSource(self._conn.nc, self.stream, self.durable)
        await source.start()
        self.ready.set()
        log.info(
            "consumer %s/%s pulling", self.stream, self.durable, extra={"consumer": self.durable}
        )
        idle = _IDLE_MIN
        silent = 0
        idle_since: float | None = None
        last_check = time.monotonic()
        limit = self.batch_size if self._batch_handler else self.concurrency
        while not self._stop.is_set():
            if not await self._wait_capacity(limit):
                break
            free = limit - self.in_flight
            started = time.monotonic()
            result = await source.fetch(min(self.batch_size, free), self._stop)
            for msg in result.surplus:
                await self._nak_quietly(msg)
            if result.messages:
                crash_point("after_fetch")
                idle, silent, idle_since = _IDLE_MIN, 0, None
                if self._batch_handler:
                    self._spawn(self._handle_batch(result.messages), result.messages)
                else:
                    for msg in result.messages:
                        self._spawn(self._handle_one(msg), [msg])
                continue
            if result.outcome == "stopped":
                break
            if self._conn.nc.is_closed:
                raise ConnectionFailed(f"consumer {self.durable}: the NATS connection is closed")
            if result.outcome == "silent":
                silent += 1
                if silent >= _SILENT_REBUILD:
                    await self._rebuild(f"{silent} pull requests went unanswered")
                    silent = 0
            elif result.outcome == "error":
                log.warning(
                    "pull %s: %s", self.durable, result.detail, extra={"consumer": self.durable}
                )
                if result.status == "409" and "deleted" in result.detail.lower():
                    await self._rebuild(result.detail)
            else:
                silent = 0
                idle_since = idle_since or started
                if time.monotonic() - max(idle_since, last_check) >= _STALL_CHECK:
                    last_check = time.monotonic()
                    await self._check_stall()
            # Back off between empty fetches; a long poll that waited counts toward it.
            await self._sleep(idle - (time.monotonic() - started))
            idle = min(idle * 2, _IDLE_MAX)

    async def _wait_capacity(self, limit: int) -> bool:
        while self.in_flight >= limit:
            self._freed.clear()
            if not await self._wait_any(self._freed):
                return False
        return not self._stop.is_set()

    async def _wait_any(self, event: asyncio.Event) -> bool:
        """Wait for ``event`` or stop; False when stopping."""
        waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._stop.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return not self._stop.is_set()

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), seconds)

    async def _rebuild(self, why: str) -> None:
        """Fresh inbox, and the consumer provisioned again if it vanished."""
        assert self._source is not None
        log.warning("consumer %s: %s; rebuilding the pull subscription", self.durable, why)
        for msg in await self._source.rebuild():
            await self._nak_quietly(msg)
        try:
            await self._conn.js.consumer_info(self.stream, self.durable)
        except NotFoundError:
            if self.provision and self.spec is not None:
                from meshforge import topology

                with contextlib.suppress(Exception):  # retried at the next rebuild
                    await topology.ensure(self._conn.js, await self._missing_streams(), [self.spec])
        except Exception as exc:  # server still away: the next fetch tells
            log.info("consumer %s: info unavailable: %s", self.durable, exc)

    async def _check_stall(self) -> None:
        """Empty fetches while the server holds undelivered messages: a stalled request."""
        try:
            info = await self._conn.js.consumer_info(self.stream, self.durable)
        except Exception:  # unreachable server: the fetches will say so
            return
        if (info.num_pending or 0) > 0:
            await self._rebuild(f"{info.num_pending} messages pending but fetches return none")

    # ------------------------------------------------------------------ push
    async def _run_push(self) -> None:
        subject, group = self._deliver
        self._push_sub = await self._conn.nc.subscribe(subject, queue=group, cb=self._on_push)
        self.ready.set()
        log.info("consumer %s/%s push group %s", self.stream, self.durable, group)
        await self._stop.wait()

    async def _on_push(self, msg: Msg) -> None:
        if (msg.headers or {}).get("Status"):
            if msg.reply:  # flow control asks for an empty reply
                await self._conn.nc.publish(msg.reply)
            return
        if self._stop.is_set() or not await self._wait_capacity(self.concurrency):
            await self._nak_quietly(msg)
            return
        self._spawn(self._handle_one(msg), [msg])

    # ------------------------------------------------------------------ work
    def _spawn(self, work: Any, msgs: list[Msg]) -> None:
        task: asyncio.Task[None] = asyncio.create_task(work)
        self._tasks[task] = msgs
        self._in_flight.set(self.in_flight)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        self._in_flight.set(self.in_flight)
        self._freed.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("consumer %s: worker failed", self.durable, exc_info=task.exception())

    def _admit(self, msg: Msg) -> tuple[Delivery, Decision | None]:
        """A delivery, and a decision when it must not reach the handler."""
        delivery = Delivery.of(msg, self.durable)
        self._consumed.inc()
        if delivery.num_delivered > 1:
            self._redelivered.inc()
        if self.decode:
            try:
                delivery.envelope = decode(
                    msg.data, delivery.headers, default_ts=delivery.stored_ts
                )
            except MalformedMessage as exc:
                return delivery, Decision.dead_letter(REASON_MALFORMED, exc)
        if self.max_deliver is not None and delivery.num_delivered > self.max_deliver:
            return delivery, Decision.dead_letter(
                REASON_MAX_DELIVERIES,
                f"delivered {delivery.num_delivered} times; the limit is {self.max_deliver}",
            )
        return delivery, None

    def _decide(self, exc: BaseException, delivery: Delivery) -> Decision:
        return decide(
            exc,
            delivery.num_delivered,
            max_deliver=self.max_deliver,
            backoff=self._acker.backoff if self._acker else (),
            unrecoverable=self.unrecoverable,
        )

    async def _handle_one(self, msg: Msg) -> None:
        assert self._acker is not None and self._chain is not None
        delivery, decision = self._admit(msg)
        if decision is None:
            async with self._acker.keep_alive(
                [msg], self._keepalive_period(delivery.num_delivered)
            ):
                try:
                    decision = await self._chain(delivery) or Decision.ack()
                except Exception as exc:
                    decision = self._decide(exc, delivery)
            if decision.action is Action.NAK and self._last_delivery(delivery):
                decision = Decision.dead_letter(REASON_MAX_DELIVERIES, "nak on the last delivery")
        await self._acker.apply(delivery, decision)

    def _last_delivery(self, delivery: Delivery) -> bool:
        # The server would never act on this nak (its MaxDeliver is reached): it would strand.
        return self.max_deliver is not None and 0 < self._server_max <= delivery.num_delivered

    async def _handle_batch(self, msgs: list[Msg]) -> None:
        assert self._acker is not None and self._batch_handler is not None
        ready: list[Delivery] = []
        settled: list[tuple[Delivery, Decision]] = []
        for msg in msgs:
            delivery, decision = self._admit(msg)
            if decision is None:
                ready.append(delivery)
            else:
                settled.append((delivery, decision))
        if ready:
            longest = max(d.num_delivered for d in ready)
            start = time.perf_counter()
            async with self._acker.keep_alive(
                [d.msg for d in ready], self._keepalive_period(longest)
            ):
                try:
                    async with asyncio.timeout(self._handler_timeout):
                        decisions = list(await self._batch_handler(ready))
                    if len(decisions) != len(ready):
                        raise RuntimeError(
                            f"batch handler returned {len(decisions)} decisions for {len(ready)} messages"
                        )
                except Exception as exc:
                    log.warning("batch handler failed: %s", exc, extra={"consumer": self.durable})
                    decisions = [self._decide(exc, d) for d in ready]
            self._batch_seconds.observe(time.perf_counter() - start)
            settled += [(d, dec or Decision.ack()) for d, dec in zip(ready, decisions, strict=True)]
        await asyncio.gather(*(self._acker.apply(d, dec) for d, dec in settled))

    async def _nak_quietly(self, msg: Msg) -> None:
        with contextlib.suppress(MsgAlreadyAckdError, Exception):  # lost nak: ack wait redelivers
            await msg.nak()
            self.metrics.naked.labels(consumer=self.durable).inc()

    # ------------------------------------------------------------------ shutdown
    async def _shutdown(self) -> None:
        self._stop.set()
        if self._source is not None:
            for msg in await self._source.close():
                await self._nak_quietly(msg)
            self._source = None
        sub, self._push_sub = self._push_sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # closed connection: nothing more arrives
                await sub.drain()  # type: ignore[no-untyped-call]  # the callback naks what is buffered
        timeout = self._stop_timeout
        if timeout is None:
            timeout = self.settings.shutdown_timeout
        if self._tasks:
            log.info(
                "consumer %s: waiting up to %.1fs for %d in flight",
                self.durable,
                timeout,
                self.in_flight,
            )
            await asyncio.wait(list(self._tasks), timeout=timeout)
        left = dict(self._tasks)
        for task, msgs in left.items():
            for msg in msgs:
                await self._nak_quietly(msg)
            task.cancel()
        if left:
            log.warning(
                "consumer %s: nak'ed %d unfinished message(s)",
                self.durable,
                sum(map(len, left.values())),
            )
            await asyncio.gather(*left, return_exceptions=True)
        self._stop_timeout = None
