"""The effect loop: each command gets exactly one effect however often it is delivered.

``Engine.handle`` is a consumer batch handler. The batches handed to it wait for the
commit stage, which takes all of them that are waiting (up to ``max_batch`` commands: a
light load gives small groups, a backlog full ones) into ONE store transaction. It locks
the resources involved (in sorted order, so workers sharing the consumer cannot
deadlock), and for each delivery in stream order: a key already processed has its stored
outputs published again (same ids); a new one runs the handler step over the
resource's evolving state (``meshforge.runtime.step``: the typed payload decoded, the
resource key, the handler with its timeout, the outputs and their size checks, the
failure decision; ``AgentHarness`` runs the same step). The group's states, events and
outputs commit together; the keys whose outputs the previous groups published are
marked in the same transaction. The outputs
then go to the publish stage (``meshforge.runtime.stage``), which sends groups in commit
order while the next group already commits; each ``handle`` call returns its decisions
once its outputs are out, and the consumer acks. A crash anywhere before the ack ends in
a redelivery that finds the key and re-publishes, so no effect is lost or doubled.

A transaction that fails for a reason of its own (not a retriable store error) is split
in halves and run again, so one bad command costs only itself: a value the store can
never hold (NUL in PostgreSQL text, a number out of range) is dead-lettered
``unrecoverable``, anything else is retried on its own. What every failure becomes (a
handler's error, the store's, a publish's, a hold, the delivery limit) is the failure
policy's (``meshforge.consume.policy``): the engine asks it and carries out the answer.

Example::

    engine = Engine(OrderAgent(), store, publisher, settings=settings)
    consumer = Consumer(conn, agent_consumer("order", settings), batch_handler=engine.handle)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from meshforge.config import Settings
from meshforge.consume.decisions import (
    REASON_MALFORMED,
    Action,
    Decision,
    Delivery,
)
from meshforge.consume.policy import Cause, Outcome
from meshforge.envelope import H_MSG_ID, Envelope, decode, derive_id
from meshforge.errors import (
    PublishError,
    StoreError,
    one_line,
)
from meshforge.ops.faults import crash_point
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.runtime.agent import Agent, CommandSpec
from meshforge.runtime.effects import Conflict, EffectStore, Opened, Plan, Work, drive
from meshforge.runtime.holds import STOPPED_POLL, Holds, Slot
from meshforge.runtime.killswitch import KillSwitch
from meshforge.runtime.marks import PublishedMarks
from meshforge.runtime.outputs import stored_event
from meshforge.runtime.stage import PublishStage
from meshforge.runtime.step import Step, failure_policy
from meshforge.store.base import Store, StoredOutput
from meshforge.topology.partitions import partitioned
from meshforge.topology.scope import Scope, command_scope

__all__ = ["Engine", "consumer_name", "failure_policy"]

log = logging.getLogger("meshforge.engine")
S = TypeVar("S")
T = TypeVar("T")

# A batch whose effect key another worker committed meanwhile is simply run again.
_BATCH_ATTEMPTS = 4
_MARK_IDLE = 1.0  # seconds without a commit before published marks get their own
_GROUP_BATCHES = 4  # fetches one transaction may take under a backlog
# A group this small runs its transaction on the event loop when the store allows
# (``Engine._run_inline``); handlers longer than the bound (seconds) end that, a
# transaction longer than it pauses that.
_INLINE_MAX = 8
_INLINE_BOUND = 0.02
_INLINE_PAUSE, _INLINE_PAUSE_MAX = 1.0, 60.0
_INLINE_LAG = 0.003


def consumer_name(agent: str) -> str:
    """The durable consumer of an agent, which also names its effects in the store."""
    return f"{agent}_consumer"


@dataclass(slots=True)
class _Batch:
    """The deliveries of one ``handle`` call: their decisions, and when they are settled."""

    decisions: list[Decision | None]
    works: list[Work]
    done: asyncio.Future[None]
    taken: bool = False  # committed in some call's group (maybe another call's)


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
        holds: Holds | None = None,
        kill_switch: KillSwitch | None = None,
    ) -> None:
        self.agent = agent
        self.store = store
        self.publisher = publisher
        self.settings = settings or Settings()
        self.metrics = metrics or Metrics.default()
        self.consumer = consumer_name(agent.name)
        #: What each failure becomes (the engine only carries its decisions out).
        self.policy = failure_policy(agent, self.settings.max_deliver, self.settings.backoff)
        #: The outstanding commands of each resource (shared by the engines of a worker).
        self.holds = holds or Holds(self.consumer)
        self._holds_loaded = False
        label = self.metrics.held_commands.labels(consumer=self.consumer)
        label.set_function(lambda: self.holds.held_now()[0])
        label = self.metrics.oldest_hold_seconds.labels(consumer=self.consumer)
        label.set_function(lambda: self.holds.held_now()[1])
        #: Opened by an outage of the store (shared by a worker's engines and consumers).
        self.kill_switch = kill_switch or KillSwitch(self.metrics)
        #: Most commands one transaction takes from the batches waiting for it: under a
        #: backlog several fetches share a commit (fewer syncs, fewer pages written again).
        self.max_batch = _GROUP_BATCHES * self.settings.batch_size
        #: What a consumer feeding this engine should fetch at most at once, and hold: a
        #: group publishing, one committing and the next one waiting, so the store thread
        #: finds a whole group ready when it finishes one. (A fetch returns at once with
        #: what there is: under a light load, groups stay small.)
        self.fetch_size = self.max_batch
        self.max_held = 3 * self.max_batch
        #: Decode, key, handler, outputs, sizes, failure decisions: what the harness runs too.
        self.step = Step(
            agent, self.policy, handler_timeout=handler_timeout or self.settings.handler_timeout,
            partitions=self.settings.partitions,
        )  # fmt: skip
        self._commands = self.step.commands
        # Plain-function handlers (no awaiting) may run with their transaction in one trip.
        self._sync_commands = self.step.sync_commands
        # The batch's transaction lives in this one thread from BEGIN to COMMIT.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"meshforge-{agent.name}-store")
        # One transaction at a time; the publish stage keeps their order on the wire.
        self._commit = asyncio.Lock()
        self._queue: deque[_Batch] = deque()
        self._stage = PublishStage(self.consumer, publisher, self.kill_switch)
        self._tx = EffectStore(agent, store, self.consumer, self.holds)
        self._marks = PublishedMarks(self._flush_marks, idle=_MARK_IDLE)
        # Small groups' transactions may run on the event loop (``_run_inline``).
        self._inline = True
        self._inline_after = 0.0  # not before this time (monotonic)
        self._inline_pause = _INLINE_PAUSE
        self._least_age, self._aged_at = float("inf"), time.time()  # see ``_behind``
        self._handlers_took = 0.0  # seconds, the last group's handlers

    @property
    def handler_timeout(self) -> float:
        """An async handler's limit unless its command or agent has one: it is kept alive
        with in_progress meanwhile, however it compares with the ack wait."""
        return self.step.handler_timeout

    @handler_timeout.setter
    def handler_timeout(self, seconds: float) -> None:
        self.step.handler_timeout = seconds

    def close(self) -> None:
        """Release the store thread (the store itself belongs to the caller)."""
        self._marks.close()
        self._thread.shutdown(wait=True)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # ------------------------------------------------------------------ the batch

    async def handle(self, deliveries: Sequence[Delivery]) -> list[Decision]:
        """One decision per delivery, same order; see the module docstring."""
        batch = _Batch([None] * len(deliveries), [], asyncio.get_running_loop().create_future())
        forwards: list[tuple[int, StoredOutput]] = []
        for i, delivery in enumerate(deliveries):
            verdict = self._admit(i, delivery)
            if isinstance(verdict, Work):
                verdict.owner = batch.decisions
                batch.works.append(verdict)
            elif isinstance(verdict, StoredOutput):
                forwards.append((i, verdict))
            else:
                batch.decisions[i] = verdict
        if forwards:
            decision = await self._forward([f for _, f in forwards])
            for i, _ in forwards:
                batch.decisions[i] = decision
        if batch.works:
            self.holds.arrive(batch.works)
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
        works: list[Work] = []
        while self._queue and (
            not works or len(works) + len(self._queue[0].works) <= self.max_batch
        ):
            batch = self._queue.popleft()
            batch.taken = True
            group.append(batch)
            works += batch.works
        # Same-resource commands run in the order they were stored.
        works.sort(key=lambda w: w.delivery.seq)
        overlapping = self._stage.busy
        try:
            works = await self._hold_back(works)
            for index, work in enumerate(works):
                work.index = index
            plan = await self._attempt(works) if works else Plan()
            decided = await self._stop_behind([(works[i], d) for i, d in plan.decisions.items()])
        except BaseException as exc:
            for batch in group:
                if not batch.done.done():
                    # A cancelled group's waiters were cancelled with it: nobody reads these.
                    batch.done.cancel() if isinstance(
                        exc, asyncio.CancelledError
                    ) else batch.done.set_exception(exc)
            raise
        if overlapping:
            crash_point("after_commit_while_publishing")
        self._conclude(decided)
        for work in plan.done:
            self.holds.finish(work)
            self.holds.applied((work.scope, work.resource), work.env.key)
        if plan.duplicates:
            self.metrics.duplicates_skipped.labels(consumer=self.consumer).inc(plan.duplicates)
        done = plan.done
        items = [o for w in done for o in w.outputs]  # published as they were stored

        def sent() -> None:
            self._marks.add([(w.scope, w.env.key) for w in done if w.fresh])

        def failed() -> None:
            for work in done:
                work.decide(self.policy.decide(Outcome(Cause.PUBLISH, self._attempts(work))))

        self._stage.submit(items, on_sent=sent, on_failed=failed, settle=[b.done for b in group])

    async def _hold_back(self, works: list[Work]) -> list[Work]:
        """The works that may run now; the others (an earlier command of their resource is
        still to be applied) are nak'ed to come back after it, their held delivery counted."""
        limit = self.settings.max_deliver
        # Near the limit, the store's count of held deliveries decides (another worker of
        # a shared durable may have held this command and counted it there).
        near = [w for w in works if w.delivery.num_delivered >= limit]
        whole = not self._holds_loaded or self.holds.stale()
        if whole or near:
            keys = [] if whole else [(w.scope, w.env.key) for w in near]
            try:
                await self._in_thread(self.store.run, lambda tx: self.holds.load(tx, keys))
                self._holds_loaded = True
            except StoreError as exc:  # an outage: the group's own transaction meets it too
                log.debug("%s: held-delivery counts not read: %s", self.consumer, one_line(exc))
        exhausted = [w for w in near if self.policy.past_limit(self._attempts(w))]
        if exhausted:
            # The delivery after the last attempt never runs (a worker killed by this
            # command on every attempt still ends in a dead letter): it ends here, the
            # way a dead letter decided in the transaction does (a stop behind it first).
            self._conclude(await self._stop_behind(
                [(w, self.policy.decide(Outcome(Cause.EXHAUSTED, self._attempts(w)))) for w in exhausted]
            ))  # fmt: skip
            ended = {id(w) for w in exhausted}
            works = [w for w in works if id(w) not in ended]
        if self.holds.quiet(works):
            return works
        await self.holds.recheck(works)
        run, held = self.holds.split(works)
        if held:
            await self._count_held([w for w, _ in held])
            for work, delay in held:
                work.decide(self.policy.decide(Outcome(Cause.HELD, delay=delay)))
                self.holds.away((work.scope, work.resource), work.delivery.seq, delay)
            self.metrics.held_back.labels(consumer=self.consumer).inc(len(held))
            log.debug(
                "%s: %d command(s) held behind earlier ones of their resources",
                self.consumer,
                len(held),
            )
        return run

    async def _count_held(self, works: list[Work]) -> None:
        """Count a held delivery for each, in the store first (a wait, not an attempt)."""
        try:
            await self._in_thread(self.store.run, lambda tx: self.holds.count(tx, works))
        except StoreError as exc:
            log.warning(
                "%s: could not count %d held command(s): %s",
                self.consumer,
                len(works),
                one_line(exc),
            )

    async def _stop_behind(
        self, decided: list[tuple[Work, Decision]]
    ) -> list[tuple[Work, Decision]]:
        """The decisions for works not applied, with the stops the policy asks for stored
        first: a dead letter of an agent with ``hold_after_dead_letter`` keeps its resource
        held (its stop stored before the dead letter goes out; a stop that cannot be stored
        is no dead letter yet: it comes back, still the head)."""
        heads = [w for w, d in decided if self.policy.stops(d)]
        if not heads:
            return decided
        try:
            await self._in_thread(self.store.run, lambda tx: self.holds.stop(tx, heads))
        except StoreError as exc:
            log.warning("%s: could not store the hold behind %d dead letter(s): %s",
                        self.consumer, len(heads), one_line(exc))  # fmt: skip
            retry = self.policy.decide(Outcome(Cause.STOP_FAILED, error=exc))
            return [(w, retry if self.policy.stops(d) else d) for w, d in decided]
        log.warning(
            "%s: %d resource(s) stay held behind a dead-lettered command until it is"
            " re-driven or `meshforge holds release`",
            self.consumer,
            len(heads),
        )
        return decided

    def _conclude(self, decided: list[tuple[Work, Decision]]) -> None:
        """Give works not applied their decisions, and tell the holds what became of them."""
        for work, decision in decided:
            work.decide(decision)
            if decision.action is Action.NAK:
                delay = decision.delay if decision.delay is not None else self._delay(work)
                self.holds.away((work.scope, work.resource), work.delivery.seq, delay or 0.0)
            else:
                self.holds.finish(work)

    def _to_partition(self, delivery: Delivery, env: Envelope) -> StoredOutput | None:
        """A five-token command to a partitioned agent goes on to its partition's subject,
        where the resource's other commands are: on its own durable it could overtake them
        or be overtaken. Same body and headers; a message id of its own (the stream's
        duplicate check would drop the original's), derived, so a retried forward is one."""
        if not self.settings.partitions or delivery.subject.count(".") != 4:
            return None
        subject = partitioned(delivery.subject, env, self.settings)
        msg_id = derive_id(env.id, -1)
        return StoredOutput(
            0, subject, msg_id, delivery.data, {**delivery.headers, H_MSG_ID: msg_id}
        )

    async def _forward(self, forwards: list[StoredOutput]) -> Decision:
        try:
            await self.publisher.publish_many(forwards)
        except PublishError as exc:
            log.warning("%s: forwarding %d command(s) to their partitions failed: %s",
                        self.consumer, len(forwards), one_line(exc))  # fmt: skip
            return self.policy.decide(Outcome(Cause.FORWARD, error=exc))
        return Decision.ack()

    def _admit(self, index: int, delivery: Delivery) -> Work | Decision | StoredOutput:
        env = delivery.envelope
        if env is None:
            return self.policy.decide(
                Outcome(
                    Cause.REFUSED, error="no envelope could be decoded", reason=REASON_MALFORMED
                )
            )
        spec = self._spec_of(env, delivery.subject)
        if spec is None:
            return self.step.unknown(env)
        forward = self._to_partition(delivery, env)
        if forward is not None:
            return forward
        scope = command_scope(delivery.subject, env.tenant_id)
        try:
            env, resource = self.step.prepare(spec, env, delivery.data)
        except Exception as exc:
            return self._failure(
                delivery, exc, self.holds.attempts(scope, env.key, delivery.num_delivered)
            )
        return Work(index, delivery, env, spec, resource, scope, position=index)

    def slot_of(self, subject: str, data: bytes, headers: dict[str, str]) -> Slot | None:
        """The resource a stored command is about; None when this agent would not run it."""
        try:
            env = decode(data, headers)
            spec = self._spec_of(env, subject)
            if spec is None:
                return None
            return command_scope(subject, env.tenant_id), self.step.prepare(spec, env, data)[1]
        except Exception:
            return None

    def reload_holds(self) -> None:
        """Read the held-delivery counts again before the next group (a durable was taken
        over: its previous owner may have counted some)."""
        self._holds_loaded = False

    def _spec_of(self, env: Envelope, subject: str) -> CommandSpec | None:
        """The agent's command an envelope names (by its type, else its subject), or None."""
        prefix = self.agent.name + "."
        if env.type.startswith(prefix):
            return self._commands.get(env.type[len(prefix) :])
        tokens = subject.split(".")
        # A type naming another agent is not ours, whatever the subject says.
        if "." in env.type or len(tokens) < 5 or tokens[3] != self.agent.name:
            return None
        return self._commands.get(tokens[4])

    async def _attempt(self, works: list[Work]) -> Plan:
        """Run the works in one transaction; if it fails for a reason of its own, split them."""
        try:
            return await self._retrying(works)
        except StoreError as exc:
            return await self._split(works, exc)

    async def _retrying(self, works: list[Work]) -> Plan:
        """One transaction, run again on conflicts and retriable errors; raises the others.
        An outage of the store holds it (kept alive) and probes until the store answers."""
        attempt = probes = 0
        while attempt < _BATCH_ATTEMPTS:
            try:
                plan = await self._run(works)
            except Conflict:
                log.info(
                    "%s: another worker stored an effect of this batch; running it again",
                    self.consumer,
                )
            except StoreError as exc:
                decision = self.policy.decide(Outcome(Cause.STORE, error=exc))
                if decision.action is Action.IN_PROGRESS:  # an outage: never count it against them
                    self._reset(works)
                    self.kill_switch.open("store", exc)
                    probes += 1
                    await self.kill_switch.pause(probes)
                    continue
                if not exc.retriable:
                    raise
                if attempt == _BATCH_ATTEMPTS - 1:
                    log.warning(
                        "%s: store failed, batch will be redelivered: %s", self.consumer, exc
                    )
                    return self._all(works, decision)
            else:
                self.kill_switch.close("store")
                return plan
            attempt += 1
            self._reset(works)
        return self._all(
            works, self.policy.decide(Outcome(Cause.STORE, error="conflicts with other workers"))
        )

    async def _split(self, works: list[Work], exc: StoreError) -> Plan:
        """Bisect a batch whose transaction failed: the innocent halves commit, the culprit
        alone is dead-lettered (data no store can take) or retried."""
        self._reset(works)
        if len(works) == 1:
            return Plan(decisions={works[0].index: self._store_failure(works[0], exc)})
        log.info("%s: transaction of %d commands failed (%s); splitting it",
                 self.consumer, len(works), one_line(exc))  # fmt: skip
        mid = len(works) // 2
        plan = await self._attempt(works[:mid])
        # A resource whose earlier command waits (or stopped) must not run its later ones first.
        held = {(w.scope, w.resource): b for w in works[:mid]
                if (d := plan.decisions.get(w.index)) is not None and (b := self._waits_behind(d)) is not None}  # fmt: skip
        rest: list[Work] = []
        behind: list[Work] = []
        for work in works[mid:]:
            waits = held.get((work.scope, work.resource))
            if waits is not None:
                plan.decisions[work.index] = waits
                behind.append(work)
            else:
                rest.append(work)
        if behind:
            await self._count_held(behind)
        if rest:
            second = await self._attempt(rest)
            plan.decisions.update(second.decisions)
            plan.done += second.done
            plan.duplicates += second.duplicates
        return plan

    def _waits_behind(self, decision: Decision) -> Decision | None:
        """What a later command of the same resource in the batch becomes when an earlier
        one got ``decision``: held until it is due again (a nak) or while its resource is
        stopped (a dead letter that stops it), else None (it may run)."""
        if decision.action is Action.NAK:
            return self.policy.decide(Outcome(Cause.HELD, delay=decision.delay))
        if self.policy.stops(decision):  # its stop is stored before its dead letter goes out
            return self.policy.decide(Outcome(Cause.HELD, delay=STOPPED_POLL))
        return None

    def _store_failure(self, work: Work, exc: StoreError) -> Decision:
        return self._failure(work.delivery, exc, self._attempts(work), Cause.STORE)

    @staticmethod
    def _reset(works: list[Work]) -> None:
        for work in works:
            work.outputs, work.events, work.fresh = [], [], False

    @staticmethod
    def _all(works: list[Work], decision: Decision) -> Plan:
        return Plan(decisions={w.index: decision for w in works})

    async def _run(self, works: list[Work]) -> Plan:
        """One transaction. Plain-function handlers need no event loop: the whole of it runs
        in one trip to the store thread. Others take two: open and read, then (after the
        handlers ran here) write and commit. Each trip waits for a thread switch."""
        # Published keys ride along in this transaction: no transaction of their own.
        marks = self._marks.take()
        failure: BaseException | None = None
        try:
            if self._sync_commands.issuperset(w.spec.name for w in works):
                # A light load only: a backlog at the server (or here) wants the store
                # thread, which commits while this loop fetches and publishes.
                inline = (self._inline and len(works) <= _INLINE_MAX and not self._queue
                          and works[-1].delivery.pending == 0 and not self._behind(works[0]))  # fmt: skip
                ran = self._run_inline(works, marks) if inline else None
                plan = (
                    ran if ran is not None else await self._in_thread(self._run_here, works, marks)
                )
            else:
                cm, tx, raw, stored = await self._in_thread(self._tx.open, works)
                try:
                    plan = await self._process(works, raw, stored)
                    crash_point("after_handler")
                except BaseException as exc:
                    await self._in_thread(self._tx.abort, cm, exc)
                    raise
                await self._in_thread(self._tx.finish, cm, tx, plan, marks)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            retry = isinstance(failure, Conflict) or (
                isinstance(failure, StoreError) and failure.retriable
            )
            self._marks.done(marks, failure, retry=retry)
        crash_point("after_commit")
        return plan

    def _behind(self, oldest: Work) -> bool:
        """Whether the oldest command of a group waited here longer than ``_INLINE_LAG``
        (a backlog in this process, which the server's pending count does not see): its
        age since the stream stored it, less the least age seen lately (transit, and the
        offset between the two clocks), which may creep up 1 ms a second with the clocks."""
        now = time.time()
        age = now - oldest.delivery.timestamp.timestamp()
        self._least_age = min(age, self._least_age + (now - self._aged_at) * 1e-3)
        self._aged_at = now
        return age - self._least_age > _INLINE_LAG

    def _run_inline(self, works: list[Work], marks: list[tuple[Scope, str]]) -> Plan | None:
        """The whole transaction right here on the event loop, if the store can begin it
        without waiting (else None): for a small group whose handlers are all plain
        functions, with no backlog behind it. No hand-over to the store thread and back,
        no contention with this thread for the GIL on every statement: at a light load
        that halves a command's latency. The loop must not stall, though. Handlers that
        took longer than ``_INLINE_BOUND`` (one that blocks) send every later transaction
        to the store thread; a transaction that did for another reason (a slow disk, a
        checkpoint, the machine pausing the process) sends the next second's there, the
        next two seconds' if the first one after that is slow again, and so on up to a
        minute."""
        started = time.monotonic()
        if started < self._inline_after:
            return None
        begun = self._tx.open_now(works)
        if begun is None:
            return None
        try:
            return self._run_opened(works, marks, begun)
        finally:
            took = time.monotonic() - started
            if self._handlers_took > _INLINE_BOUND:
                self._inline = False
                log.warning(
                    "%s: handlers took %.0f ms on the event loop; this agent's transactions"
                    " run in its store thread from now on",
                    self.consumer, self._handlers_took * 1e3,
                )  # fmt: skip
            elif took > _INLINE_BOUND:
                self._inline_after = time.monotonic() + self._inline_pause
                log.info(
                    "%s: a transaction took %.0f ms on the event loop; the next %g s of"
                    " them run in the store thread",
                    self.consumer, took * 1e3, self._inline_pause,
                )  # fmt: skip
                self._inline_pause = min(2 * self._inline_pause, _INLINE_PAUSE_MAX)
            else:
                self._inline_pause = _INLINE_PAUSE

    def _run_here(self, works: list[Work], marks: list[tuple[Scope, str]]) -> Plan:
        """The whole transaction in the store thread (every handler a plain function)."""
        return self._run_opened(works, marks, self._tx.open(works))

    def _run_opened(self, works: list[Work], marks: list[tuple[Scope, str]], begun: Opened) -> Plan:
        cm, tx, raw, stored = begun
        try:
            started = time.monotonic()
            plan = drive(self._process(works, raw, stored))
            self._handlers_took = time.monotonic() - started
            crash_point("after_handler")
        except BaseException as exc:
            self._tx.abort(cm, exc)
            raise
        self._tx.finish(cm, tx, plan, marks)
        return plan

    async def _process(
        self,
        works: list[Work],
        raw: dict[tuple[Scope, str], bytes | None],
        stored: dict[tuple[Scope, str], list[StoredOutput] | None],
    ) -> Plan:
        limits = self.publisher.limits()
        run = self.step.run
        plan = Plan()
        plan.states = states = {r: self._decode(data) for r, data in raw.items()}
        blocked: dict[
            tuple[Scope, str], Decision
        ] = {}  # resource -> what its later commands become
        for work in works:
            d = work.delivery
            slot = (work.scope, work.resource)
            waits = blocked.get(slot)
            if waits is not None:
                plan.decisions[work.index] = waits
                plan.held.append(work)  # counted with this transaction: a wait, not an attempt
                continue
            previous = stored.get((work.scope, work.env.key))
            if previous is not None:
                work.outputs = previous
                plan.done.append(work)
                plan.duplicates += 1
                # Seed 001's words, so an operator's search for them finds it.
                log.info("Duplicate detected: %s key %r (%s, stream seq %d) was processed before;"
                         " re-publishing its %d stored output(s)", self.consumer, work.env.key,
                         work.scope, d.seq, len(previous))  # fmt: skip
                continue
            try:
                new_state, work.outputs, work.events = await run(
                    work.spec, work.env, work.resource, d.subject, states[slot], limits, work.scope
                )
            except Exception as exc:
                # The handler may have changed the state in place: rebuild it.
                states[slot] = self._rebuild(slot, raw[slot], plan)
                decision = self._failure(d, exc, self._attempts(work))
                plan.decisions[work.index] = decision
                waits = self._waits_behind(decision)
                if waits is not None:
                    blocked[slot] = waits
                continue
            states[slot] = new_state
            work.fresh = True
            stored[(work.scope, work.env.key)] = work.outputs  # a later duplicate re-publishes
            plan.done.append(work)
        return plan

    def _decode(self, data: bytes | None) -> S:
        return self.agent.initial() if data is None else self.agent.decode_state(data)

    def _rebuild(self, slot: tuple[Scope, str], data: bytes | None, plan: Plan) -> S:
        """The resource's state as of the batch start plus the events this batch made."""
        state = self._decode(data)
        for work in plan.done:
            if work.fresh and (work.scope, work.resource) == slot:
                for event in work.events:
                    state = self.agent.apply(
                        state, stored_event(self.agent, event.type, event.data)
                    )
        return state

    # ------------------------------------------------------------------ published marks

    async def _flush_marks(self) -> None:
        async with self._commit:
            marks = self._marks.take()
            try:
                await self._in_thread(self._tx.mark_published, marks)
            finally:
                self._marks.done(marks, None)

    # ------------------------------------------------------------------ failures

    def _attempts(self, work: Work) -> int:
        return self.holds.attempts(work.scope, work.env.key, work.delivery.num_delivered)

    def _delay(self, work: Work) -> float | None:
        return self.policy.delay(self._attempts(work))

    def _failure(
        self, delivery: Delivery, exc: BaseException, attempts: int, cause: Cause = Cause.HANDLER
    ) -> Decision:
        """The decision for a command whose handler (or key, or transaction) failed with
        ``exc`` on its ``attempts``-th attempt (held deliveries are not attempts)."""
        decision = self.step.decide(exc, attempts, cause)
        if decision.action is not Action.DEAD_LETTER or decision.reason == "max_deliveries":
            log.warning("%s: transient failure of %s (attempt %d): %s", self.consumer,
                        delivery.subject, attempts, one_line(exc))  # fmt: skip
        return decision
