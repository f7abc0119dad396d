"""The effect loop: each command gets exactly one effect however often it is delivered.

``Engine.handle`` is a consumer batch handler. For one batch of deliveries it opens ONE
store transaction, locks the resources involved (in sorted order, so workers sharing
the consumer cannot deadlock), and for each delivery in stream order: a key already
processed has its stored outputs published again (same ids) and is acked; a new one runs
its handler over the resource's evolving state. Then the new states, events and outputs
of the whole batch are committed together, the outputs are published pipelined, and
the decisions go back to the consumer, which acks. A crash anywhere before the ack
ends in a redelivery that finds the key and re-publishes, so no effect is lost or doubled.
A transaction that fails for a reason of its own (not a retriable store error) is split
in halves and run again, so one bad command costs only itself: a value the store can
never hold (NUL in PostgreSQL text, a number out of range) is dead-lettered
``unrecoverable``, anything else is retried on its own.

Example::

    engine = Engine(OrderAgent(), store, publisher, settings=settings)
    consumer = Consumer(conn, agent_consumer("order", settings), batch_handler=engine.handle)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from meshforge.config import Settings
from meshforge.decisions import (
    REASON_UNRECOVERABLE,
    Action,
    Decision,
    Delivery,
    backoff_delay,
    decide,
)
from meshforge.envelope import Envelope, Outbound
from meshforge.errors import InvalidSubject, PublishError, StoreError, Unrecoverable, one_line
from meshforge.faults import crash_point
from meshforge.observability import Metrics
from meshforge.publisher import Publisher
from meshforge.runtime.agent import Agent, CommandSpec, Event, Output
from meshforge.runtime.outputs import build_outputs, decode_payload, event_name
from meshforge.store.base import NewEvent, Store, StoredOutput, Transaction

__all__ = ["Engine", "consumer_name"]

log = logging.getLogger("meshforge.engine")
S = TypeVar("S")
T = TypeVar("T")

# Errors that say "this command can never succeed": dead letter, never retry.
_UNRECOVERABLE: tuple[type[BaseException], ...] = (
    Unrecoverable, ValueError, KeyError, TypeError, IndexError, InvalidSubject,
)  # fmt: skip
# A batch whose effect key another worker committed meanwhile is simply run again.
_BATCH_ATTEMPTS = 4
_STORE_RETRY_DELAY = 0.5


def consumer_name(agent: str) -> str:
    """The durable consumer of an agent, which also names its effects in the store."""
    return f"{agent}_consumer"


@dataclass(slots=True)
class _Work:
    """One delivery of the batch on its way through the loop."""

    index: int
    delivery: Delivery
    env: Envelope
    spec: CommandSpec
    resource: str
    outputs: list[StoredOutput] = field(default_factory=list)
    events: list[NewEvent] = field(default_factory=list)
    fresh: bool = False  # ran its handler in this batch (not a stored effect)


@dataclass(slots=True)
class _Plan:
    """What one attempt of the batch decided: per-index decisions and work to publish."""

    decisions: dict[int, Decision] = field(default_factory=dict)
    done: list[_Work] = field(default_factory=list)
    duplicates: int = 0
    states: dict[str, Any] = field(default_factory=dict)


class _Conflict(Exception):
    """Another worker stored an effect this batch also computed: run the batch again."""


class Engine(Generic[S]):
    """Runs one agent's commands with exactly-once effects; ``handle`` is the batch handler."""

    def __init__(
        self,
        agent: Agent[S],
        store: Store,
        publisher: Publisher,
        *,
        settings: Settings | None = None,
        metrics: Metrics | None = None,
        handler_timeout: float | None = None,
    ) -> None:
        self.agent = agent
        self.store = store
        self.publisher = publisher
        self.settings = settings or Settings()
        self.metrics = metrics or Metrics.default()
        self.consumer = consumer_name(agent.name)
        self.handler_timeout = handler_timeout or min(self.settings.ack_wait / 2, 30.0)
        self._commands = agent.commands()
        # The batch's transaction lives in this one thread from BEGIN to COMMIT.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"meshforge-{agent.name}-store")
        # One batch at a time, commit to publish: same-resource outputs leave in order.
        self._serial = asyncio.Lock()

    def close(self) -> None:
        """Release the store thread (the store itself belongs to the caller)."""
        self._thread.shutdown(wait=True)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # ------------------------------------------------------------------ the batch

    async def handle(self, deliveries: Sequence[Delivery]) -> list[Decision]:
        """One decision per delivery, same order; see the module docstring."""
        async with self._serial:
            return await self._handle(deliveries)

    async def _handle(self, deliveries: Sequence[Delivery]) -> list[Decision]:
        decisions: list[Decision | None] = [None] * len(deliveries)
        works: list[_Work] = []
        for i, delivery in enumerate(deliveries):
            verdict = self._admit(i, delivery)
            if isinstance(verdict, _Work):
                works.append(verdict)
            else:
                decisions[i] = verdict
        # Same-resource commands run in the order they were stored.
        works.sort(key=lambda w: w.delivery.seq)
        plan = await self._attempt(works) if works else _Plan()
        for index, decision in plan.decisions.items():
            decisions[index] = decision
        if plan.done:
            failed = await self._publish(plan.done)
            for work in failed:
                decisions[work.index] = Decision.nak(self._delay(work.delivery))
        if plan.duplicates:
            self.metrics.duplicates_skipped.labels(consumer=self.consumer).inc(plan.duplicates)
        crash_point("after_publish")
        return [d if d is not None else Decision.ack() for d in decisions]

    def _admit(self, index: int, delivery: Delivery) -> _Work | Decision:
        env = delivery.envelope
        if env is None:
            return Decision.dead_letter("malformed", "no envelope could be decoded")
        name = self._command_of(env, delivery.subject)
        spec = self._commands.get(name) if name else None
        if spec is None:
            return Decision.dead_letter(
                "unrecoverable",
                f"unknown command {env.type!r} for agent {self.agent.name!r}"
                f" (known: {', '.join(sorted(self._commands)) or 'none'})",
            )
        try:
            resource = self.agent.resource_key(env, spec)
        except Exception as exc:
            return self._failure(delivery, exc)
        return _Work(index, delivery, env, spec, resource)

    def _command_of(self, env: Envelope, subject: str) -> str | None:
        prefix = self.agent.name + "."
        if env.type.startswith(prefix):
            return env.type[len(prefix) :]
        tokens = subject.split(".")
        # A type naming another agent is not ours, whatever the subject says.
        if "." in env.type or len(tokens) < 5 or tokens[3] != self.agent.name:
            return None
        return tokens[4]

    async def _attempt(self, works: list[_Work]) -> _Plan:
        """Run the works in one transaction; if it fails for a reason of its own, split them."""
        try:
            return await self._retrying(works)
        except StoreError as exc:
            return await self._split(works, exc)

    async def _retrying(self, works: list[_Work]) -> _Plan:
        """One transaction, run again on conflicts and retriable errors; raises the others."""
        for attempt in range(1, _BATCH_ATTEMPTS + 1):
            try:
                return await self._run(works)
            except _Conflict:
                log.info("%s: another worker stored an effect of this batch; running it again", self.consumer)
            except StoreError as exc:
                if not exc.retriable:
                    raise
                if attempt == _BATCH_ATTEMPTS:
                    log.warning("%s: store failed, batch will be redelivered: %s", self.consumer, exc)
                    return self._nak_all(works)
            self._reset(works)
        return self._nak_all(works)

    async def _split(self, works: list[_Work], exc: StoreError) -> _Plan:
        """Bisect a batch whose transaction failed: the innocent halves commit, the culprit
        alone is dead-lettered (data no store can take) or retried."""
        self._reset(works)
        if len(works) == 1:
            return _Plan(decisions={works[0].index: self._store_failure(works[0], exc)})
        log.info("%s: transaction of %d commands failed (%s); splitting it",
                 self.consumer, len(works), one_line(exc))  # fmt: skip
        mid = len(works) // 2
        plan = await self._attempt(works[:mid])
        # A resource whose earlier command waits must not run its later ones first.
        held = {w.resource: d.delay for w in works[:mid]
                if (d := plan.decisions.get(w.index)) is not None and d.action is Action.NAK}  # fmt: skip
        rest: list[_Work] = []
        for work in works[mid:]:
            if work.resource in held:
                plan.decisions[work.index] = Decision.nak(held[work.resource])
            else:
                rest.append(work)
        if rest:
            second = await self._attempt(rest)
            plan.decisions.update(second.decisions)
            plan.done += second.done
            plan.duplicates += second.duplicates
        return plan

    def _store_failure(self, work: _Work, exc: StoreError) -> Decision:
        if exc.kind == "invalid":
            # Deterministic for this message: every retry would fail the same way.
            return Decision.dead_letter(REASON_UNRECOVERABLE, exc)
        return self._failure(work.delivery, exc)

    @staticmethod
    def _reset(works: list[_Work]) -> None:
        for work in works:
            work.outputs, work.events, work.fresh = [], [], False

    def _nak_all(self, works: list[_Work]) -> _Plan:
        # Not the handler's fault: come back soon, without burning the backoff schedule.
        return _Plan(decisions={w.index: Decision.nak(_STORE_RETRY_DELAY) for w in works})

    async def _run(self, works: list[_Work]) -> _Plan:
        cm = await self._in_thread(self.store.transaction)
        tx: Transaction = await self._in_thread(cm.__enter__)
        exc_info: tuple[Any, Any, Any] = (None, None, None)
        try:
            plan = await self._process(tx, works)
            crash_point("after_handler")
            await self._in_thread(self._store_effects, tx, plan)
        except BaseException as exc:
            exc_info = (type(exc), exc, exc.__traceback__)
            raise
        finally:
            try:
                await self._in_thread(cm.__exit__, *exc_info)
            except StoreError as exc:
                if exc_info[0] is None:
                    raise
                log.debug("%s: rollback after an error also failed: %s", self.consumer, exc)
        crash_point("after_commit")
        return plan

    async def _process(self, tx: Transaction, works: list[_Work]) -> _Plan:
        agent = self.agent
        plan = _Plan()
        raw = await self._in_thread(self._load, tx, works)
        plan.states = states = {r: self._decode(data) for r, data in raw.items()}
        stored: dict[str, list[StoredOutput] | None] = await self._in_thread(
            self._effects, tx, works
        )
        blocked: dict[str, float | None] = {}  # resource -> delay of its transient failure
        for work in works:
            d = work.delivery
            if work.resource in blocked:
                plan.decisions[work.index] = Decision.nak(blocked[work.resource])
                continue
            previous = stored.get(work.env.key)
            if previous is not None:
                work.outputs = previous
                plan.done.append(work)
                plan.duplicates += 1
                continue
            try:
                async with asyncio.timeout(self.handler_timeout):
                    outputs: list[Output] = await agent.handle(
                        work.spec, work.env, states[work.resource]
                    )
                new_state, work.outputs, work.events = build_outputs(
                    agent, work.env, work.resource, d.subject, outputs, states[work.resource]
                )
            except Exception as exc:
                # The handler may have changed the state in place: rebuild it.
                states[work.resource] = self._rebuild(work.resource, raw[work.resource], plan)
                decision = self._failure(d, exc)
                plan.decisions[work.index] = decision
                if decision.action is Action.NAK:
                    blocked[work.resource] = decision.delay
                continue
            states[work.resource] = new_state
            work.fresh = True
            stored[work.env.key] = work.outputs  # a duplicate later in the batch re-publishes
            plan.done.append(work)
        return plan

    def _decode(self, data: bytes | None) -> S:
        return self.agent.initial() if data is None else self.agent.decode_state(data)

    def _rebuild(self, resource: str, data: bytes | None, plan: _Plan) -> S:
        """The resource's state as of the batch start plus the events this batch made."""
        state = self._decode(data)
        for work in plan.done:
            if work.fresh and work.resource == resource:
                for event in work.events:
                    name = event_name(self.agent.name, event.type)
                    state = self.agent.apply(state, Event(name, decode_payload(event.data)))
        return state

    # ------------------------------------------------------------------ store work (thread)

    def _load(self, tx: Transaction, works: list[_Work]) -> dict[str, bytes | None]:
        # Sorted: two workers locking the same resources take them in the same order.
        return {r: tx.state_get(self.agent.name, r) for r in sorted({w.resource for w in works})}

    def _effects(self, tx: Transaction, works: list[_Work]) -> dict[str, list[StoredOutput] | None]:
        return {key: tx.effect_get(self.consumer, key) for key in {w.env.key for w in works}}

    def _store_effects(self, tx: Transaction, plan: _Plan) -> None:
        fresh = [w for w in plan.done if w.fresh]
        events = [e for w in fresh for e in w.events]
        positions = tx.events_append(self.agent.name, events) if events else []
        last: dict[str, int] = {}
        for event, position in zip(events, positions, strict=True):
            last[event.resource_id or ""] = position
        states = plan.states
        for resource, position in sorted(last.items()):
            tx.state_put(self.agent.name, resource, self.agent.encode_state(states[resource]), position)
        for work in fresh:
            try:
                tx.effect_put(self.consumer, work.env.key, work.env.id, work.outputs)
            except StoreError as exc:
                if exc.kind == "duplicate":
                    raise _Conflict() from exc
                raise

    # ------------------------------------------------------------------ publishing

    async def _publish(self, done: list[_Work]) -> list[_Work]:
        """Publish every output of the batch; returns the works whose outputs did not all go."""
        items = [
            Outbound(subject=o.subject, data=o.data, headers=o.headers, msg_id=o.msg_id)
            for w in done
            for o in w.outputs
        ]
        if not items:
            return []
        half = max(1, len(items) // 2)
        try:
            await self.publisher.publish_many(items[:half])
            crash_point("after_partial_publish")
            if items[half:]:
                await self.publisher.publish_many(items[half:])
        except PublishError as exc:
            log.warning("%s: publishing outputs failed, batch will be redelivered: %s", self.consumer, exc)
            return done
        with contextlib.suppress(StoreError):
            await self._in_thread(self._mark_published, [w.env.key for w in done if w.fresh])
        return []

    def _mark_published(self, keys: list[str]) -> None:
        if not keys:
            return
        with self.store.transaction() as tx:
            for key in keys:
                tx.effect_mark_published(self.consumer, key)

    # ------------------------------------------------------------------ failures

    def _delay(self, delivery: Delivery) -> float | None:
        return backoff_delay(delivery.num_delivered, self.settings.backoff)

    def _failure(self, delivery: Delivery, exc: BaseException) -> Decision:
        """The decision for a command whose handler (or key) failed with ``exc``."""
        if isinstance(exc, TimeoutError):
            exc = TimeoutError(f"handler timed out after {self.handler_timeout:g}s")
        decision = decide(
            exc,
            delivery.num_delivered,
            max_deliver=self.settings.max_deliver,
            backoff=self.settings.backoff,
            unrecoverable=_UNRECOVERABLE + self.agent.unrecoverable,
        )
        if decision.action is not Action.DEAD_LETTER or decision.reason == "max_deliveries":
            log.warning("%s: transient failure of %s (delivery %d): %s", self.consumer,
                        delivery.subject, delivery.num_delivered, one_line(exc))  # fmt: skip
        return decision
