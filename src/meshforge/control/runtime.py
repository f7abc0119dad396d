"""The node runtime: pulls a node's mailbox and applies the control-plane rules, in order.

0. A command id this node is answering right now (a redelivery, a second copy): nak
   with a short delay; it comes back to rule 1 once the first run's reply is stored.
1. A command id already answered: publish the stored reply again, run nothing.
   A command of a canceled job (its ``job`` field): reply ``canceled``, run nothing.
2. ``deadline_ts`` passed: reply ``expired``, dead-letter ``expired``, run nothing.
3. ``expected_node_epoch`` set and not the current epoch: reply ``rejected``, dead-letter
   ``rejected``, run nothing.
4. ``not_before_ts`` in the future: nak with the time left as delay. The durable consumer
   has unlimited MaxDeliver, so waiting never burns deliveries; real failed runs are
   counted in the store and give up (``error`` reply + dead letter) after ``max_deliver``.
5. Otherwise run the handler (the consumer keeps long runs alive with in-progress), store
   the reply and the id in one transaction, publish the reply, ack.

Example::

    store = open_store("sqlite:///.meshforge/node.db")
    async with await connect(settings) as conn:
        runtime = NodeRuntime(DemoNode(), "lab1", "node7", conn, store, settings=settings)
        runtime.install_signal_handlers()
        await runtime.run()           # until SIGINT/SIGTERM or runtime.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec

from meshforge.config import Settings, load_settings
from meshforge.consume.consumer import Consumer, Decision, Delivery
from meshforge.consume.decisions import REASON_MAX_DELIVERIES, REASON_UNRECOVERABLE, Action
from meshforge.consume.policy import Cause, FailurePolicy, Outcome
from meshforge.control.client import node_durable
from meshforge.control.jobs import job_canceled
from meshforge.control.node import CommandContext, Node
from meshforge.control.presence import Presence
from meshforge.control.reply import Status, reply_envelope
from meshforge.deadletters.route import REASONS
from meshforge.envelope import Envelope, decode
from meshforge.errors import MalformedMessage, one_line
from meshforge.ops.faults import crash_point
from meshforge.ops.observability import Metrics
from meshforge.ops.probes import DEFAULT_PROBE_INTERVAL, Probes
from meshforge.ops.retention import cleanup_loop
from meshforge.publish.publisher import Publisher
from meshforge.store.base import Store, Transaction
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams, node_consumer
from meshforge.topology.subjects import control_reply_subject
from meshforge.transport.connection import Connection

__all__ = ["NodeRuntime"]

log = logging.getLogger("meshforge.control.node")
#: A node's own probe of its mailbox consumer (its /metrics gauges): the fleet's depths are
#: read centrally (`ctl nodes`, one request for all), so a node asks 4x less than a worker.
NODE_PROBE_INTERVAL = 4 * DEFAULT_PROBE_INTERVAL
_RUNNING_AGAIN = 1.0  # seconds before a copy of a command still running here comes back
T = TypeVar("T")

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


def _parse_ts(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _pack(reply: Envelope, dead_letter: str | None) -> bytes:
    # Stored with the reply: whether the command is also dead-lettered, so a re-send after
    # a crash between commit and dead letter still writes it (deduplicated by the server).
    return _ENCODER.encode({"dead_letter": dead_letter, "reply": reply.encode().decode()})


def _unpack(data: bytes) -> tuple[Envelope, str | None]:
    obj = _DECODER.decode(data)
    return decode(obj["reply"].encode()), obj.get("dead_letter")


class NodeRuntime:
    """Runs one ``Node`` as ``<site>.<node>``: counts the epoch, announces presence, and
    answers every command in the mailbox exactly once (see the module docstring)."""

    def __init__(
        self,
        node: Node,
        site: str,
        name: str,
        conn: Connection,
        store: Store,
        *,
        settings: Settings | None = None,
        presence_interval: float = 10.0,
        metrics: Metrics | None = None,
        publisher: Publisher | None = None,
        cleanup_interval: float = 3600.0,
        probe_interval: float = NODE_PROBE_INTERVAL,
    ) -> None:
        self.node = node
        self.site = site
        self.name = name
        self.conn = conn
        self.store = store
        self.settings = settings if settings is not None else load_settings()
        self.metrics = metrics if metrics is not None else Metrics.default()
        self.publisher = publisher or Publisher(conn.js, self.settings, self.metrics)
        self.spec = node_consumer(site, name, self.settings)
        #: What a handler's failure becomes: the consumers' and the engine's rules, with a
        #: result that cannot be encoded (or a handler called wrongly) never retried.
        self._policy = FailurePolicy(
            max_deliver=self.settings.max_deliver, backoff=self.settings.backoff or (1.0,),
            unrecoverable=(MalformedMessage, TypeError, msgspec.EncodeError),
        )  # fmt: skip
        self.durable = node_durable(site, name)
        self.reply_subject = control_reply_subject(site, name)
        self.presence = Presence(
            conn.js,
            site,
            name,
            version=node.version,
            interval=presence_interval,
            replicas=self.settings.replicas,
            create=self.settings.provision,
        )
        self.epoch = 0
        self.cleanup_interval = cleanup_interval
        self.probe_interval = probe_interval
        self.ready = asyncio.Event()
        self.metrics.track(self.is_ready, lambda: self.conn.current_state() == "connected")
        self._consumer: Consumer | None = None
        self._stopping = False
        self._canceled: set[str] = set()
        self._running: set[str] = set()  # command ids being answered now

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Count this start in the epoch, announce, then answer commands until ``stop()``."""
        if self.settings.provision:
            await ensure(self.conn.js, default_streams(self.settings), [self.spec])
        self._set_epoch(await self._tx(lambda tx: tx.node_epoch_bump(self.site, self.name)))
        log.info("node %s.%s starting at epoch %d", self.site, self.name, self.epoch)
        await self.node.on_start(self.site, self.name, self.epoch)
        await self.presence.announce(self.epoch)
        self.presence.start(self.current_epoch)
        consumer = Consumer(
            self.conn,
            self.spec,
            handler=self._handle,
            settings=self.settings,
            max_deliver=None,
            metrics=self.metrics,
            publisher=self.publisher,
            provision=self.settings.provision,
            pull_heartbeat=self.settings.node_pull_heartbeat,
        )
        self._consumer = consumer
        waiter = asyncio.create_task(self._mark_ready(consumer))
        # Stored replies answer a command's repeats; past the retention they are deleted.
        cleanup = asyncio.create_task(
            cleanup_loop(
                "node replies", self.store.node_replies_cleanup,
                self.settings.reply_retention, interval=self.cleanup_interval,
            )
        )  # fmt: skip
        self.metrics.prepare_consumer(self.durable, REASONS)
        probes = Probes(
            self.conn.js, self.metrics, [(self.spec.stream, self.durable)], store=self.store
        )
        probing = asyncio.create_task(probes.run(self.probe_interval))
        try:
            if not self._stopping:
                await consumer.run()
        finally:
            for task in (waiter, cleanup, probing):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            # HA: another instance of this node may still be up; it re-announces within
            # one interval, so a "stopped" written here is corrected quickly.
            await self.presence.stop(self.epoch)
            await self.node.on_stop()
            log.info("node %s.%s stopped", self.site, self.name)

    async def current_epoch(self) -> int:
        """The node's epoch as its store holds it now (another instance may have bumped it)."""
        try:
            stored = await self._tx(lambda tx: tx.node_epoch(self.site, self.name))
        except Exception as exc:  # presence must not die with the store; keep the last known
            log.warning(
                "reading the epoch of %s.%s failed: %s", self.site, self.name, one_line(exc, 300)
            )
            return self.epoch
        if stored is not None:
            self._set_epoch(stored)
        return self.epoch

    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.metrics.node_epoch.labels(site=self.site, node=self.name).set(epoch)

    def is_ready(self) -> bool:
        """Pulling its mailbox and connected: what /readyz answers (503 while NATS is away)."""
        return self.ready.is_set() and self.conn.current_state() == "connected"

    async def health(self) -> dict[str, Any]:
        """The connection's health report plus the node's site, name and epoch."""
        report = await self.conn.health()
        report.update(site=self.site, node=self.name, epoch=self.epoch)
        return report

    async def _mark_ready(self, consumer: Consumer) -> None:
        await consumer.ready.wait()
        self.ready.set()

    async def stop(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Stop pulling; commands in flight finish (or are nak'ed for redelivery)."""
        self._stopping = True
        if self._consumer is not None:
            await self._consumer.stop(timeout)

    def install_signal_handlers(self) -> None:
        """SIGINT / SIGTERM stop the node gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.stop()))

    async def _tx(self, work: Callable[[Transaction], T]) -> T:
        return await asyncio.to_thread(self.store.run, work)

    # ------------------------------------------------------------------ the rules

    async def _handle(self, delivery: Delivery) -> Decision | None:
        env = delivery.envelope
        if env is None:  # the consumer decodes; this guards a consumer built without it
            return Decision.dead_letter("malformed", "control message without an envelope")
        if env.id in self._running:
            # The same command again while it runs here: a redelivery after its ack wait ran
            # out on a loaded node, or a second copy under another message id. It comes back
            # once the first run's reply is stored, and gets that reply.
            return Decision.nak(delay=_RUNNING_AGAIN)
        self._running.add(env.id)
        try:
            return await self._rules(delivery, env)
        finally:
            self._running.discard(env.id)

    async def _rules(self, delivery: Delivery, env: Envelope) -> Decision | None:
        site, name, command_id = self.site, self.name, env.id

        def look(tx: Transaction) -> tuple[bytes | None, int | None]:
            return tx.node_reply_get(site, name, command_id), tx.node_epoch(site, name)

        stored, epoch = await self._tx(look)
        if stored is not None:
            return await self._resend(stored, env)
        job = env.extra.get("job")
        if isinstance(job, str) and await self._job_canceled(job):
            return await self._finish(env, "canceled", None, f"job {job} was canceled")
        # HA instances share the store: the current epoch is the store's, not this process's.
        current = epoch if epoch is not None else self.epoch
        self._set_epoch(current)
        now = datetime.now(UTC)
        if env.deadline_ts and _parse_ts(env.deadline_ts) <= now:
            error = f"deadline {env.deadline_ts} passed before the command ran"
            return await self._finish(env, "expired", None, error, dead_letter="expired")
        expected = env.expected_node_epoch
        if expected is not None and expected != current:
            error = f"expected node epoch {expected}, the node is at epoch {current}"
            return await self._finish(env, "rejected", None, error, dead_letter="rejected")
        if env.not_before_ts:
            wait = (_parse_ts(env.not_before_ts) - now).total_seconds()
            if wait > 0:
                log.debug(
                    "command %s (%s) waits %.3fs for its not_before", command_id, env.type, wait
                )
                return Decision.nak(delay=wait)
        return await self._run(delivery, env, current)

    async def _job_canceled(self, job: str) -> bool:
        """Whether the command's job was canceled (remembered: a cancel is final)."""
        if job in self._canceled:
            return True
        if await job_canceled(self.conn.js, job):
            self._canceled.add(job)
            return True
        return False

    async def _run(self, delivery: Delivery, env: Envelope, epoch: int) -> Decision | None:
        handler = self.node.handler_for(env.type)
        if handler is None:
            error = f"unknown command {env.type!r}; this node runs {', '.join(self.node.commands()) or 'nothing'}"
            return await self._finish(env, "error", None, error, dead_letter="unrecoverable")

        def begin(tx: Transaction) -> int:
            record = tx.inbox_begin(
                env.id,
                self.durable,
                message_id=env.id,
                type=env.type,
                subject=delivery.subject,
                stream=delivery.stream,
                stream_seq=delivery.seq,
                deliveries=delivery.num_delivered,
                headers=delivery.headers,
                resource_type=env.resource_type,
                resource_id=env.resource_id,
            )
            return record.attempts

        # Counted before the run, so a command that kills the node also runs out of attempts.
        attempt = await self._tx(begin)
        if self._policy.past_limit(attempt):  # earlier attempts did not finish (killed)
            exhausted = self._policy.decide(Outcome(Cause.EXHAUSTED, attempt))
            return await self._dead(env, exhausted)
        ctx = CommandContext(site=self.site, node=self.name, epoch=epoch, envelope=env)
        self.metrics.node_commands.labels(site=self.site, node=self.name, command=env.type).inc()
        try:
            result = await handler(dict(env.payload), ctx)
            _ENCODER.encode(result)
        except Exception as exc:
            return await self._failed(env, exc, attempt)
        crash_point("after_handler")
        return await self._finish(
            env, "ok", result, None, restart=ctx.restart_requested, begun=True
        )

    async def _failed(self, env: Envelope, exc: Exception, attempt: int) -> Decision | None:
        """The handler failed: a reply and a dead letter if the policy says so, else a nak
        (the attempt noted in the inbox)."""
        decision = self._policy.decide(Outcome(Cause.HANDLER, attempt, exc))
        error = one_line(exc)
        if decision.action is Action.DEAD_LETTER:
            if decision.reason == REASON_MAX_DELIVERIES:
                decision = Decision.dead_letter(
                    decision.reason, f"failed {attempt} time(s), last: {error}"
                )
            return await self._dead(env, decision)
        await self._tx(lambda tx: tx.inbox_failed(env.id, self.durable, error))
        log.warning(
            "command %s (%s) attempt %d/%d failed: %s",
            env.id, env.type, attempt, self.settings.max_deliver, error,
        )  # fmt: skip
        return decision

    async def _dead(self, env: Envelope, decision: Decision) -> Decision | None:
        """Reply with the dead letter's status (expired, rejected, else error) and send it."""
        reason = decision.reason or REASON_UNRECOVERABLE
        status: Status = (
            "expired" if reason == "expired" else "rejected" if reason == "rejected" else "error"
        )
        return await self._finish(env, status, None, decision.error, dead_letter=reason, begun=True)

    async def _finish(
        self,
        env: Envelope,
        status: Status,
        result: Any,
        error: str | None,
        *,
        dead_letter: str | None = None,
        restart: bool = False,
        begun: bool = False,
    ) -> Decision | None:
        """Store the reply (and the id) in one transaction, publish it, then ack or dead-letter."""
        site, name = self.site, self.name

        def commit(tx: Transaction) -> tuple[bytes, bool]:
            existing = tx.node_reply_get(site, name, env.id)
            if existing is not None:  # another instance answered first: its reply stands
                return existing, False
            epoch = tx.node_epoch_bump(site, name) if restart else tx.node_epoch(site, name)
            reply = reply_envelope(
                env,
                site=site,
                node=name,
                status=status,
                result=result,
                error=error,
                node_epoch=epoch,
            )
            packed = _pack(reply, dead_letter)
            tx.node_reply_put(site, name, env.id, packed)
            if begun:
                tx.inbox_done(env.id, self.durable)
            return packed, True

        packed, fresh = await self._tx(commit)
        crash_point("after_commit")
        reply, reason = _unpack(packed)
        await self.publisher.publish(self.reply_subject, reply)
        self._count_reply(reply)
        crash_point("after_publish")
        epoch = reply.payload.get("node_epoch")
        log.info(
            "command %s (%s) -> %s at epoch %s",
            env.id,
            env.type,
            reply.payload.get("status"),
            epoch,
        )
        if fresh and restart and isinstance(epoch, int):
            self._set_epoch(epoch)
            await self.presence.announce(epoch, started_at=reply.ts)
        if reason is not None:
            return Decision.dead_letter(reason, reply.payload.get("error") or reason)
        return Decision.ack()

    async def _resend(self, stored: bytes, env: Envelope) -> Decision | None:
        reply, reason = _unpack(stored)
        self.metrics.duplicates_skipped.labels(consumer=self.durable).inc()
        log.info("command %s (%s) already answered; sending its reply again", env.id, env.type)
        await self.publisher.publish(self.reply_subject, reply)
        self._count_reply(reply)
        if reason is not None:
            return Decision.dead_letter(reason, reply.payload.get("error") or reason)
        return Decision.ack()

    def _count_reply(self, reply: Envelope) -> None:
        status = str(reply.payload.get("status"))
        self.metrics.node_replies.labels(site=self.site, node=self.name, status=status).inc()
