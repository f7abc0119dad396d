"""The effect loop: each command gets exactly one effect however often it is delivered.

``Engine.handle`` is a consumer batch handler. The batches handed to it wait for the
commit stage, which takes all of them that are waiting (up to ``max_batch`` commands: a
light load gives small groups, a backlog full ones) into ONE store transaction. It locks
the resources involved (in sorted order, so workers sharing the consumer cannot
deadlock), and for each delivery in stream order: a key already processed has its stored
outputs published again (same ids); a new one runs its handler over the resource's
evolving state. The group's states, events and outputs commit together; the keys whose
outputs the previous groups published are marked in the same transaction. The outputs
then go to the publish stage (``meshforge.runtime.stage``), which sends groups in commit
order while the next group already commits; each ``handle`` call returns its decisions
once its outputs are out, and the consumer acks. A crash anywhere before the ack ends in
a redelivery that finds the key and re-publishes, so no effect is lost or doubled.

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
import inspect
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

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
from meshforge.errors import InvalidSubject, StoreError, Unrecoverable, one_line
from meshforge.faults import crash_point
from meshforge.observability import Metrics
from meshforge.publisher import Publisher
from meshforge.runtime.agent import Agent, CommandSpec, Event, Output
from meshforge.runtime.outputs import build_outputs, decode_payload, event_name
from meshforge.runtime.stage import PublishStage
from meshforge.scope import Scope, command_scope
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
_MARK_IDLE = 1.0  # seconds without a commit before published marks get their own


def _drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run to its end a coroutine that never suspends (handlers that are plain functions)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coro.close()
    raise RuntimeError("a plain-function handler returned something to await")


def consumer_name(agent: str) -> str:
    """The durable consumer of an agent, which also names its effects in the store."""
    return f"{agent}_consumer"


@dataclass(slots=True)
class _Work:
    """One delivery on its way through the loop."""

    index: int  # its place in the group being committed
    delivery: Delivery
    env: Envelope
    spec: CommandSpec
    resource: str
    scope: Scope  # the subject's tenant and namespace: the key of everything stored for it
    position: int = 0  # its place among its handle() call's deliveries
    owner: list[Decision | None] = field(default_factory=list)  # that call's decisions
    outputs: list[StoredOutput] = field(default_factory=list)
    events: list[NewEvent] = field(default_factory=list)
    fresh: bool = False  # ran its handler in this batch (not a stored effect)

    def decide(self, decision: Decision) -> None:
        self.owner[self.position] = decision


@dataclass(slots=True)
class _Batch:
    """The deliveries of one ``handle`` call: their decisions, and when they are settled."""

    decisions: list[Decision | None]
    works: list[_Work]
    done: asyncio.Future[None]
    taken: bool = False  # committed in some call's group (maybe another call's)


@dataclass(slots=True)
class _Plan:
    """What one attempt of the batch decided: per-index decisions and work to publish."""

    decisions: dict[int, Decision] = field(default_factory=dict)
    done: list[_Work] = field(default_factory=list)
    duplicates: int = 0
    states: dict[tuple[Scope, str], Any] = field(default_factory=dict)


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
        #: Most commands one transaction takes from the batches waiting for it.
        self.max_batch = self.settings.batch_size
        self._commands = agent.commands()
        # Plain-function handlers behind the stock Agent.handle run without awaiting anything.
        stock = type(agent).handle is Agent.handle
        self._sync_commands = frozenset(
            name for name, spec in self._commands.items()
            if stock and not inspect.iscoroutinefunction(spec.handler)
        )  # fmt: skip
        # The batch's transaction lives in this one thread from BEGIN to COMMIT.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"meshforge-{agent.name}-store")
        # One transaction at a time; the publish stage keeps their order on the wire.
        self._commit = asyncio.Lock()
        self._queue: deque[_Batch] = deque()
        self._stage = PublishStage(self.consumer, publisher)
        self._marks: list[tuple[Scope, str]] = []  # keys whose outputs went out: next commit notes them
        self._commits = 0
        self._flusher: asyncio.Task[None] | None = None
        self._closed = False

    def close(self) -> None:
        """Release the store thread (the store itself belongs to the caller)."""
        self._closed = True
        if self._flusher is not None:
            self._flusher.cancel()
        self._thread.shutdown(wait=True)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # ------------------------------------------------------------------ the batch

    async def handle(self, deliveries: Sequence[Delivery]) -> list[Decision]:
        """One decision per delivery, same order; see the module docstring."""
        batch = _Batch([None] * len(deliveries), [], asyncio.get_running_loop().create_future())
        for i, delivery in enumerate(deliveries):
            verdict = self._admit(i, delivery)
            if isinstance(verdict, _Work):
                verdict.owner = batch.decisions
                batch.works.append(verdict)
            else:
                batch.decisions[i] = verdict
        if batch.works:
            self._queue.append(batch)
            crash_point("after_enqueue")
            async with self._commit:
                if not batch.taken:  # else an earlier call committed it in its group
                    await self._commit_group()
            # Shielded: the publish stage settles every batch of a group, whoever waits.
            await asyncio.shield(batch.done)
        return [d if d is not None else Decision.ack() for d in batch.decisions]

    async def _commit_group(self) -> None:
        """Commit the batches waiting (up to ``max_batch`` commands) in one transaction and
        hand their outputs to the publish stage: the next group commits while they go out."""
        group: list[_Batch] = []
        works: list[_Work] = []
        while self._queue and (not works or len(works) + len(self._queue[0].works) <= self.max_batch):
            batch = self._queue.popleft()
            batch.taken = True
            group.append(batch)
            works += batch.works
        # Same-resource commands run in the order they were stored.
        works.sort(key=lambda w: w.delivery.seq)
        for index, work in enumerate(works):
            work.index = index
        overlapping = self._stage.busy
        try:
            plan = await self._attempt(works)
        except BaseException as exc:
            for batch in group:
                if not batch.done.done():
                    batch.done.set_exception(exc)
            raise
        if overlapping:
            crash_point("after_commit_while_publishing")
        for index, decision in plan.decisions.items():
            works[index].decide(decision)
        if plan.duplicates:
            self.metrics.duplicates_skipped.labels(consumer=self.consumer).inc(plan.duplicates)
        done = plan.done
        items = [
            Outbound(subject=o.subject, data=o.data, headers=o.headers, msg_id=o.msg_id)
            for w in done
            for o in w.outputs
        ]

        def sent() -> None:
            self._marks += [(w.scope, w.env.key) for w in done if w.fresh]
            self._schedule_flush()

        def failed() -> None:
            for work in done:
                work.decide(Decision.nak(self._delay(work.delivery)))

        self._stage.submit(items, on_sent=sent, on_failed=failed, settle=[b.done for b in group])

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
        scope = command_scope(delivery.subject, env.tenant_id)
        return _Work(index, delivery, env, spec, resource, scope, position=index)

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
        held = {(w.scope, w.resource): d.delay for w in works[:mid]
                if (d := plan.decisions.get(w.index)) is not None and d.action is Action.NAK}  # fmt: skip
        rest: list[_Work] = []
        for work in works[mid:]:
            if (work.scope, work.resource) in held:
                plan.decisions[work.index] = Decision.nak(held[(work.scope, work.resource)])
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
        """One transaction. Plain-function handlers need no event loop: the whole of it runs
        in one trip to the store thread. Others take two: open and read, then (after the
        handlers ran here) write and commit. Each trip waits for a thread switch."""
        # Published keys ride along in this transaction: no transaction of their own.
        marks, self._marks = self._marks, []
        try:
            if self._sync_commands.issuperset(w.spec.name for w in works):
                plan = await self._in_thread(self._run_here, works, marks)
            else:
                cm, tx, raw, stored = await self._in_thread(self._open, works)
                try:
                    plan = await self._process(works, raw, stored)
                    crash_point("after_handler")
                except BaseException as exc:
                    await self._in_thread(self._abort, cm, exc)
                    raise
                await self._in_thread(self._finish, cm, tx, plan, marks)
        except BaseException as exc:
            self._keep_marks(marks, exc)
            raise
        finally:
            self._commits += 1
        crash_point("after_commit")
        return plan

    def _run_here(self, works: list[_Work], marks: list[tuple[Scope, str]]) -> _Plan:
        """The whole transaction in the store thread (every handler a plain function)."""
        cm, tx, raw, stored = self._open(works)
        try:
            plan = _drive(self._process(works, raw, stored))
            crash_point("after_handler")
        except BaseException as exc:
            self._abort(cm, exc)
            raise
        self._finish(cm, tx, plan, marks)
        return plan

    def _keep_marks(self, marks: list[tuple[Scope, str]], exc: BaseException) -> None:
        # Only an audit aid: kept for the next try unless they may be what failed.
        if isinstance(exc, _Conflict) or (isinstance(exc, StoreError) and exc.retriable):
            self._marks = marks + self._marks
        elif marks:
            log.debug("%s: %d published marks dropped with a failed transaction", self.consumer, len(marks))

    async def _process(
        self,
        works: list[_Work],
        raw: dict[tuple[Scope, str], bytes | None],
        stored: dict[tuple[Scope, str], list[StoredOutput] | None],
    ) -> _Plan:
        agent = self.agent
        plan = _Plan()
        plan.states = states = {r: self._decode(data) for r, data in raw.items()}
        blocked: dict[tuple[Scope, str], float | None] = {}  # resource -> delay of its failure
        for work in works:
            d = work.delivery
            slot = (work.scope, work.resource)
            if slot in blocked:
                plan.decisions[work.index] = Decision.nak(blocked[slot])
                continue
            previous = stored.get((work.scope, work.env.key))
            if previous is not None:
                work.outputs = previous
                plan.done.append(work)
                plan.duplicates += 1
                continue
            try:
                outputs: list[Output]
                if work.spec.name in self._sync_commands:
                    # Never suspends, so a timer could not interrupt it: spare one per command.
                    outputs = await agent.handle(work.spec, work.env, states[slot])
                else:
                    async with asyncio.timeout(self.handler_timeout):
                        outputs = await agent.handle(work.spec, work.env, states[slot])
                new_state, work.outputs, work.events = build_outputs(
                    agent, work.env, work.resource, d.subject, outputs, states[slot]
                )
            except Exception as exc:
                # The handler may have changed the state in place: rebuild it.
                states[slot] = self._rebuild(slot, raw[slot], plan)
                decision = self._failure(d, exc)
                plan.decisions[work.index] = decision
                if decision.action is Action.NAK:
                    blocked[slot] = decision.delay
                continue
            states[slot] = new_state
            work.fresh = True
            stored[(work.scope, work.env.key)] = work.outputs  # a later duplicate re-publishes
            plan.done.append(work)
        return plan

    def _decode(self, data: bytes | None) -> S:
        return self.agent.initial() if data is None else self.agent.decode_state(data)

    def _rebuild(self, slot: tuple[Scope, str], data: bytes | None, plan: _Plan) -> S:
        """The resource's state as of the batch start plus the events this batch made."""
        state = self._decode(data)
        for work in plan.done:
            if work.fresh and (work.scope, work.resource) == slot:
                for event in work.events:
                    name = event_name(self.agent.name, event.type)
                    state = self.agent.apply(state, Event(name, decode_payload(event.data)))
        return state

    # ------------------------------------------------------------------ store work (thread)

    def _open(
        self, works: list[_Work]
    ) -> tuple[AbstractContextManager[Transaction], Transaction, dict[tuple[Scope, str], bytes | None],
               dict[tuple[Scope, str], list[StoredOutput] | None]]:  # fmt: skip
        """BEGIN, lock and read the resources, read the stored effects."""
        cm = self.store.transaction()
        tx = cm.__enter__()
        try:
            return cm, tx, self._load(tx, works), self._effects(tx, works)
        except BaseException as exc:
            self._abort(cm, exc)
            raise

    def _finish(
        self,
        cm: AbstractContextManager[Transaction],
        tx: Transaction,
        plan: _Plan,
        marks: list[tuple[Scope, str]],
    ) -> None:
        """Write the group's effects and COMMIT (or roll back and raise)."""
        try:
            self._store_effects(tx, plan, marks)
        except BaseException as exc:
            self._abort(cm, exc)
            raise
        cm.__exit__(None, None, None)

    def _abort(self, cm: AbstractContextManager[Transaction], exc: BaseException) -> None:
        try:
            cm.__exit__(type(exc), exc, exc.__traceback__)
        except StoreError as err:
            if err is not exc:
                log.debug("%s: rollback after an error also failed: %s", self.consumer, err)

    def _load(self, tx: Transaction, works: list[_Work]) -> dict[tuple[Scope, str], bytes | None]:
        # Sorted: two workers locking the same resources take them in the same order.
        name = self.agent.name
        slots = sorted({(w.scope, w.resource) for w in works})
        return {(s, r): tx.state_get(name, r, scope=s) for s, r in slots}

    def _effects(
        self, tx: Transaction, works: list[_Work]
    ) -> dict[tuple[Scope, str], list[StoredOutput] | None]:
        keys = {(w.scope, w.env.key) for w in works}
        return {(s, k): tx.effect_get(self.consumer, k, scope=s) for s, k in keys}

    def _store_effects(self, tx: Transaction, plan: _Plan, marks: list[tuple[Scope, str]]) -> None:
        fresh = [w for w in plan.done if w.fresh]
        by_scope: dict[Scope, list[NewEvent]] = {}
        for w in fresh:
            by_scope.setdefault(w.scope, []).extend(w.events)
        last: dict[tuple[Scope, str], int] = {}
        for scope, events in sorted(by_scope.items()):
            if not events:
                continue
            positions = tx.events_append(self.agent.name, events, scope=scope)
            for event, position in zip(events, positions, strict=True):
                last[(scope, event.resource_id or "")] = position
        states = plan.states
        for (scope, resource), position in sorted(last.items()):
            data = self.agent.encode_state(states[(scope, resource)])
            tx.state_put(self.agent.name, resource, data, position, scope=scope)
        for work in fresh:
            try:
                tx.effect_put(self.consumer, work.env.key, work.env.id, work.outputs, scope=work.scope)
            except StoreError as exc:
                if exc.kind == "duplicate":
                    raise _Conflict() from exc
                raise
        for scope, key in marks:
            tx.effect_mark_published(self.consumer, key, scope=scope)

    # ------------------------------------------------------------------ published marks

    def _schedule_flush(self) -> None:
        if self._flusher is None and not self._closed:
            self._flusher = asyncio.ensure_future(self._flush_when_idle(self._commits))

    async def _flush_when_idle(self, commits: int) -> None:
        """Note published keys in a transaction of their own only when no batch came to
        carry them for a while."""
        try:
            while True:
                await asyncio.sleep(_MARK_IDLE)
                if self._commits == commits or not self._marks:
                    break
                commits = self._commits
            async with self._commit:
                marks, self._marks = self._marks, []
                if marks and not self._closed:
                    await self._in_thread(self._mark_published, marks)
        except (StoreError, RuntimeError) as exc:  # audit aid only; RuntimeError: closed
            log.debug("%s: published marks not stored: %s", self.consumer, exc)
        finally:
            self._flusher = None
            if self._marks:
                self._schedule_flush()

    def _mark_published(self, keys: list[tuple[Scope, str]]) -> None:
        with self.store.transaction() as tx:
            for scope, key in keys:
                tx.effect_mark_published(self.consumer, key, scope=scope)

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
