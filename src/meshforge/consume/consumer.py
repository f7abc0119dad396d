"""The consumer: pull or push delivery, bounded concurrency, ack decisions, graceful stop.

A ``Consumer`` takes messages from a durable JetStream consumer and runs a handler for
each (or a batch handler per fetch). It never holds more messages than it can work on:
a pull asks for at most ``concurrency - in flight`` (a batch consumer: batches of at
most ``batch_size``, holding ``max_held`` messages at most: by default two batches, the
next while one finishes; consumers given one ``Budget`` share one ``max_held``), a push
consumer is capped by ``max_ack_pending``.
Malformed bodies and exhausted deliveries are dead-lettered without reaching the
handler; handler errors become decisions (see ``meshforge.consume.decisions``); a handler that
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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from nats.errors import MsgAlreadyAckdError
from nats.js.errors import NotFoundError

from meshforge.config import Settings, load_settings
from meshforge.consume.ack import Acker
from meshforge.consume.decisions import (
    Action,
    BatchHandler,
    Decision,
    Delivery,
    Handler,
    Middleware,
)
from meshforge.consume.middleware import (
    chain,
    logging_middleware,
    metrics_middleware,
    timeout_middleware,
    tracing_middleware,
)
from meshforge.consume.pull import Pause, PullLoop, PullSource
from meshforge.consume.push import ensure_push_consumer
from meshforge.consume.work import Budget, Limits, Processor, Workers
from meshforge.errors import ConfigError, ConnectionFailed, MissingTopology, TopologyError, one_line
from meshforge.ops.observability import Metrics
from meshforge.transport.headers import server_status

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from meshforge.publish.publisher import Publisher
    from meshforge.topology.ownership import Tenure
    from meshforge.topology.specs import ConsumerSpec
    from meshforge.transport.connection import Connection

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
# A batch consumer that caught up with its stream waits up to this long (seconds) for its
# work in flight before fetching again (``PullLoop``): at 1,000 commands a second an
# agent's p50 went from 15-25 ms to 12-13 ms, its p99 from 62-66 to 28-40 (a slow VM).
_GATHER = 0.01
_PULL_WAITS = 5  # a pull request's expires, in heartbeats (5 s for the default 1 s)


async def _leave(msg: Msg) -> None:
    """What a fenced consumer does with a message it gives up: nothing (it comes due)."""


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


#: ``max_deliver`` default: one less than the consumer's MaxDeliver (the last delivery is
#: kept for dead-lettering), or ``settings.max_deliver`` when the server has no limit.
DEFAULT: Any = _Default()


class Consumer:
    """Runs ``handler`` (or ``batch_handler``) for the messages of one durable consumer.

    ``spec`` is a ``ConsumerSpec`` (provisioned with ``provision.ensure`` when
    ``provision``, else checked with ``provision.verify``) or ``"STREAM/durable"`` for a
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
        max_held: int | None = None,
        owner: Tenure | None = None,
        pause: Pause | None = None,
        budget: Budget | None = None,
        pull_heartbeat: float = 1.0,
    ) -> None:
        if (handler is None) == (batch_handler is None):
            raise ConfigError("consumer: give exactly one of handler= or batch_handler=")
        if mode not in ("pull", "push"):
            raise ConfigError(f"consumer mode: expected 'pull' or 'push', got {mode!r}")
        if batch_handler is not None and mode != "pull":
            raise ConfigError("consumer: a batch handler needs mode='pull'")
        if batch_handler is not None and middlewares:
            raise ConfigError(
                "consumer: middlewares wrap a handler of one delivery; a batch handler runs without them"
            )
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
        # Batch mode: two batches by default, the next fetched and handled while one acks.
        self.max_held = max_held or 2 * self.batch_size
        if self.concurrency < 1 or self.batch_size < 1 or self.max_held < self.batch_size:
            raise ConfigError(
                "consumer: concurrency and batch_size must be >= 1, max_held >= batch_size"
            )
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
        self._stop_timeout: float | None = None
        self._running = False
        #: With a budget (shared by the consumers feeding one engine), ``max_held`` is the
        #: lane's: this consumer fetches only what the lane has room for.
        self._budget = budget
        # A pull request waits up to ``_PULL_WAITS`` heartbeats for its first message; two
        # missed heartbeats mean the request is gone (a fleet's idle nodes beat slower).
        self._pull_heartbeat = pull_heartbeat
        self._workers = Workers(self.durable, self.metrics, self._stop, budget)
        self._deliver: tuple[str, str] = ("", "")
        self._processor: Processor | None = None
        self._source: PullSource | None = None
        self._push_sub: Subscription | None = None
        self._signal_tasks: set[asyncio.Future[None]] = set()
        # A durable with a priority group (a partition's): pulls carry the group and pin,
        # and who owns it is asked of its tenure (the worker's, else one of its own).
        if owner is None and self.spec is not None and self.spec.priority_group:
            from meshforge.topology.ownership import Tenure

            owner = Tenure(self.spec)
        self.owner = owner
        self.priority_group = owner.group if owner is not None else None
        #: While it says paused (an outage: the worker's kill switch) nothing is fetched.
        self.pause = pause
        self._acker: Acker | None = None
        self.fenced = False
        if owner is not None:
            owner.attach(self.fence)

    # ------------------------------------------------------------------ lifecycle
    @property
    def in_flight(self) -> int:
        """Messages being handled now."""
        return self._workers.in_flight

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

    @property
    def pinned(self) -> bool:
        """The server has pinned this consumer's pulls (a durable with a priority group)."""
        return self._source is not None and self._source.pin is not None

    def fence(self) -> None:
        """Another worker owns this durable now: stop fetching at once, stop extending the
        ack wait of what is in flight (so it comes due for the new owner), and nak nothing
        (a nak would put a later command before earlier ones still in flight). What is in
        flight still finishes; the store makes a command the new owner applied too a
        duplicate."""
        if self.fenced:
            return
        self.fenced = True
        if self._acker is not None:
            self._acker.silence()
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """Make SIGINT and SIGTERM call ``stop()`` (on the running event loop)."""
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            task = asyncio.ensure_future(self.stop())
            self._signal_tasks.add(task)  # a strong reference until it is done
            task.add_done_callback(self._signal_tasks.discard)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)

    # ------------------------------------------------------------------ setup
    def _get_publisher(self) -> Publisher:
        if self._publisher is None:
            from meshforge.publish.publisher import Publisher

            self._publisher = Publisher(self._conn.js, self.settings, self.metrics)
        return self._publisher

    async def _prepare(self) -> None:
        js = self._conn.js
        if self.spec is not None and self.mode == "pull":
            from meshforge.topology import provision

            if self.provision:
                await provision.ensure(js, await self._missing_streams(), [self.spec])
            else:
                await provision.verify(js, [], [self.spec])
        elif self.spec is not None:
            missing = await self._missing_streams() if self.provision else []
            if missing:
                from meshforge.topology import provision

                await provision.ensure(js, missing, [])
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
        except Exception as exc:  # a denied request only times out; the -ERR says why
            why = self._conn.last_error or one_line(exc, 300) or type(exc).__name__
            raise TopologyError(
                f"cannot read consumer {self.stream}/{self.durable}: {why}"
            ) from None
        if self.spec is None and self.mode == "push":
            self._deliver = (info.config.deliver_subject or "", info.config.deliver_group or "")
            if not self._deliver[0]:
                raise ConfigError(f"consumer {self.stream}/{self.durable} is not a push consumer")
        config = info.config
        server_max = config.max_deliver or -1
        if self._max_deliver_arg is DEFAULT:
            limit = max(1, server_max - 1) if server_max > 0 else self.settings.max_deliver
        else:
            limit = self._max_deliver_arg
        limits = Limits(
            max_deliver=limit,
            server_max=server_max,
            ack_wait=float(config.ack_wait or self.settings.ack_wait),
            wait_backoff=tuple(config.backoff or ()),
        )
        self.max_deliver = limit
        acker = self._acker = Acker(
            self.durable,
            self.metrics,
            self._get_publisher,
            backoff=limits.wait_backoff or self.settings.backoff,
            ack_sync=self._ack_sync,
            server_wait=(limits.ack_wait, limits.wait_backoff),
        )
        self._processor = Processor(
            self.durable,
            acker,
            self.metrics,
            limits,
            chain=self._chain,
            batch_handler=self._batch_handler,
            decode=self.decode,
            unrecoverable=self.unrecoverable,
            batch_timeout=self._handler_timeout,
        )

    async def _missing_streams(self) -> list[Any]:
        """The CONTRACT stream spec for our stream when it does not exist yet."""
        from meshforge.topology.specs import default_streams

        wanted = [s for s in default_streams(self.settings) if s.name == self.stream]
        if not wanted:
            return []
        try:
            await self._conn.js.stream_info(self.stream)
        except NotFoundError:
            return wanted
        return []

    # ------------------------------------------------------------------ pull
    async def _run_pull(self) -> None:
        assert self._processor is not None
        processor, workers = self._processor, self._workers
        batch = self._batch_handler is not None

        def dispatch(msgs: list[Msg]) -> None:
            if batch:
                workers.spawn(processor.handle_batch(msgs), msgs)
            else:
                for msg in msgs:
                    workers.spawn(processor.handle_one(msg), [msg])

        heartbeat = self._pull_heartbeat
        source = PullSource(
            self._conn.nc, self.stream, self.durable,
            expires=heartbeat * _PULL_WAITS, heartbeat=heartbeat, group=self.priority_group,
        )  # fmt: skip
        await source.start()
        self._source = source
        loop = PullLoop(
            source,
            stop=self._stop,
            batch_size=self.batch_size,
            wait_free=workers.wait_free,
            in_flight=lambda: workers.load,
            limit=self.max_held if batch else self.concurrency,
            dispatch=dispatch,
            nak=self._nak_quietly,
            recover=self._recover,
            pending=self._pending,
            closed=lambda: self._conn.nc.is_closed,
            owner=self.owner,
            gather=_GATHER if batch else 0.0,
            pause=self.pause,
            reserve=self._budget.add if self._budget is not None else None,
        )
        self.ready.set()
        log.info("consumer %s/%s pulling", self.stream, self.durable)
        try:
            await loop.run()
        except ConnectionError as exc:
            raise ConnectionFailed(f"consumer {self.durable}: {exc}") from None

    async def _recover(self) -> None:
        """After a stall: provision the consumer again if it vanished (when allowed)."""
        try:
            await self._conn.js.consumer_info(self.stream, self.durable)
        except NotFoundError:
            if self.provision and self.spec is not None:
                from meshforge.topology import provision

                with contextlib.suppress(Exception):  # retried at the next rebuild
                    await provision.ensure(
                        self._conn.js, await self._missing_streams(), [self.spec]
                    )
        except Exception as exc:  # server still away: the next fetch tells
            log.info("consumer %s: info unavailable: %s", self.durable, exc)

    async def _pending(self) -> int | None:
        """Undelivered messages the server holds for this consumer (None if unknown)."""
        try:
            info = await self._conn.js.consumer_info(self.stream, self.durable)
        except Exception:  # unreachable server: the fetches will say so
            return None
        pending: int | None = info.num_pending
        return pending

    # ------------------------------------------------------------------ push
    async def _run_push(self) -> None:
        subject, group = self._deliver
        self._push_sub = await self._conn.nc.subscribe(subject, queue=group, cb=self._on_push)
        self.ready.set()
        log.info("consumer %s/%s push group %s", self.stream, self.durable, group)
        await self._stop.wait()

    async def _on_push(self, msg: Msg) -> None:
        if server_status(msg):
            if msg.reply:  # flow control asks for an empty reply
                await self._conn.nc.publish(msg.reply)
            return
        if self._stop.is_set() or not await self._workers.wait_free(self.concurrency):
            await self._nak_quietly(msg)
            return
        assert self._processor is not None
        self._workers.spawn(self._processor.handle_one(msg), [msg])

    # ------------------------------------------------------------------ work
    async def _nak_quietly(self, msg: Msg) -> None:
        with contextlib.suppress(MsgAlreadyAckdError, Exception):  # lost nak: ack wait redelivers
            await msg.nak()
            self.metrics.naked.labels(consumer=self.durable).inc()

    # ------------------------------------------------------------------ shutdown
    async def _shutdown(self) -> None:
        self._stop.set()
        if self._source is not None:
            for msg in await self._source.close():
                if not self.fenced:  # fenced: they come due with what is in flight
                    await self._nak_quietly(msg)
            self._source = None
        sub, self._push_sub = self._push_sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # closed connection: nothing more arrives
                await sub.drain()  # type: ignore[no-untyped-call]  # the callback naks what is buffered
        timeout = self._stop_timeout
        if timeout is None:
            timeout = self.settings.shutdown_timeout
        await self._workers.finish(timeout, self._nak_quietly if not self.fenced else _leave)
        self._stop_timeout = None
        if self._conn.nc.is_connected:
            with contextlib.suppress(Exception):  # acks and naks leave before stop() returns
                await self._conn.nc.flush(timeout=2)
