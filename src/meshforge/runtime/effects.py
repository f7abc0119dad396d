"""The engine's work in the store thread: one group's transaction, and the shapes it uses.

``EffectStore.open`` begins the transaction, locks and reads the resources of a group
(in one order for every worker, so workers sharing a consumer cannot deadlock) and the
effects already stored for its keys; ``finish`` stores the effects with their outputs and
the published marks, then appends the events and writes the states (the event log's head
row, which every writer of the log waits for, is taken last), and commits. Each step is
one statement for the whole group. Either rolls back and raises on an error.
``Conflict`` says another worker stored one of the group's effects first.

Example (what ``Engine`` does for a group)::

    cm, tx, states, stored = effects.open(works)
    ...                                   # handlers run, filling a Plan
    effects.finish(cm, tx, plan, marks)   # COMMIT
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from meshforge.consume.decisions import Decision, Delivery
from meshforge.envelope import Envelope
from meshforge.errors import StoreError
from meshforge.runtime.agent import Agent, CommandSpec
from meshforge.runtime.holds import Holds
from meshforge.store.base import NewEffect, NewEvent, Store, StoredOutput, Transaction
from meshforge.store.logtail import DuplicateEffect, append_with_states, read_group, store_effects
from meshforge.topology.scope import Scope

__all__ = ["Conflict", "EffectStore", "Opened", "Plan", "Work", "drive"]

log = logging.getLogger("meshforge.engine")
T = TypeVar("T")
Slot = tuple[Scope, str]  # a resource (or an idempotency key) of one scope
# A begun transaction with what it read: (cm to leave, tx, states, stored effects).
Opened = tuple[AbstractContextManager[Transaction], Transaction, dict[Slot, bytes | None],
               dict[Slot, list[StoredOutput] | None]]  # fmt: skip


def drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run to its end a coroutine that never suspends (handlers that are plain functions)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coro.close()
    raise RuntimeError("a plain-function handler returned something to await")


@dataclass(slots=True)
class Work:
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
class Plan:
    """What one attempt of the batch decided: per-index decisions and work to publish."""

    decisions: dict[int, Decision] = field(default_factory=dict)
    done: list[Work] = field(default_factory=list)
    duplicates: int = 0
    #: Works held behind an earlier command of their resource that failed in this batch.
    held: list[Work] = field(default_factory=list)
    states: dict[tuple[Scope, str], Any] = field(default_factory=dict)


class Conflict(Exception):
    """Another worker stored an effect this batch also computed: run the batch again."""


class EffectStore:
    """One agent's transactions in the store, as the engine's store thread runs them."""

    def __init__(self, agent: Agent[Any], store: Store, consumer: str, holds: Holds) -> None:
        self.agent = agent
        self.store = store
        self.consumer = consumer
        self.holds = holds

    def open(self, works: list[Work]) -> Opened:
        """BEGIN, lock and read the resources, read the stored effects."""
        cm = self.store.transaction()
        return self._read(cm, cm.__enter__(), works)

    def open_now(self, works: list[Work]) -> Opened | None:
        """``open`` if the store can begin a transaction without waiting, else None."""
        begun = self.store.transaction_now()
        return None if begun is None else self._read(*begun, works)

    def _read(
        self, cm: AbstractContextManager[Transaction], tx: Transaction, works: list[Work]
    ) -> Opened:
        try:
            # One statement each for the whole group; the store locks in one order for
            # every worker.
            states, stored = read_group(
                tx, self.agent.name, [(w.scope, w.resource) for w in works],
                self.consumer, [(w.scope, w.env.key) for w in works],
            )  # fmt: skip
            return cm, tx, states, stored
        except BaseException as exc:
            self.abort(cm, exc)
            raise

    def finish(
        self,
        cm: AbstractContextManager[Transaction],
        tx: Transaction,
        plan: Plan,
        marks: list[tuple[Scope, str]],
    ) -> None:
        """Write the group's effects and COMMIT (or roll back and raise)."""
        try:
            try:
                self._store_effects(tx, plan, marks)
            except BaseException as exc:
                self.abort(cm, exc)
                raise
            cm.__exit__(None, None, None)
        except DuplicateEffect as exc:  # found with the COMMIT (see store_effects)
            raise Conflict() from exc

    def abort(self, cm: AbstractContextManager[Transaction], exc: BaseException) -> None:
        try:
            cm.__exit__(type(exc), exc, exc.__traceback__)
        except StoreError as err:
            if err is not exc:
                log.debug("%s: rollback after an error also failed: %s", self.consumer, err)

    def _store_effects(self, tx: Transaction, plan: Plan, marks: list[tuple[Scope, str]]) -> None:
        effects: list[NewEffect] = []
        by_scope: dict[Scope, list[NewEvent]] = {}
        for w in plan.done:
            if w.fresh:
                effects.append(NewEffect(w.env.key, w.env.id, w.outputs, w.scope))
                if w.events:
                    by_scope.setdefault(w.scope, []).extend(w.events)
        self.holds.clear_forgotten(tx)
        if plan.held:
            self.holds.count(tx, plan.held)
        try:
            store_effects(tx, self.consumer, effects, marks)
        except StoreError as exc:
            if exc.kind == "duplicate":
                raise Conflict() from exc
            raise
        # Last: from its event-log append to COMMIT, every writer of the log waits for us.
        encode = self.agent.encode_state
        for scope, events in sorted(by_scope.items()):
            states = {
                r: encode(plan.states[(scope, r)]) for r in {e.resource_id or "" for e in events}
            }
            append_with_states(tx, self.agent.name, scope, events, states)

    def mark_published(self, keys: list[tuple[Scope, str]]) -> None:
        """Note, in a transaction of its own, that these keys' outputs were published."""
        if not keys:
            return
        with self.store.transaction() as tx:
            store_effects(tx, self.consumer, [], keys)
