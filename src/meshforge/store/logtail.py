"""An agent's group transaction the way a networked store wants it: the reads that open it
in one round trip, the writes that end it sent together with the COMMIT.

``read_group`` locks and reads the resources' states and reads the effects stored for the
keys; ``store_effects`` stores the new effects and marks the keys whose outputs are
published; ``append_with_states`` appends one scope's events to the log of (scope, agent)
and stores each resource's state at the position of that resource's last event. Any
transaction does them with its plain methods (``states_get``, ``effects_get``,
``effects_put``, ``effects_mark_published``, ``events_append``, ``states_put``).

A ``LogTail`` transaction (PostgreSQL's) sends the reads together with its BEGIN and waits
once, and sends the writes (from ``store_effects`` on) with the COMMIT: the log's head row,
which every writer of the log waits for until COMMIT, is then held only while the server
runs the last statements and flushes the commit, never while the client prepares its next
statement. Nothing but further such writes may follow them in the transaction, and their
errors surface at the latest from the commit. An effect key another transaction stored
first is then reported as ``DuplicateEffect``, the same ``StoreError(kind="duplicate")``
that ``effects_put`` raises where the write waits for its answer.

Example (what the engine does in a group's transaction)::

    states, stored = read_group(tx, "order", [(scope, "o-1")], "order_consumer", [(scope, key)])
    ...                                        # handlers run
    store_effects(tx, "order_consumer", effects, published_keys)
    append_with_states(tx, "order", scope, events, {"o-1": state_bytes})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import Protocol, TypeGuard, runtime_checkable

from meshforge.errors import StoreError
from meshforge.store.base import NewEffect, NewEvent, NewState, Scoped, StoredOutput, Transaction
from meshforge.topology.scope import Scope

__all__ = ["DuplicateEffect", "LogTail", "append_with_states", "read_group", "store_effects"]


class DuplicateEffect(StoreError):
    """An effect key that another transaction stored first, found by the commit of a
    ``LogTail`` transaction (see the module docstring)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="duplicate")


@runtime_checkable
class LogTail(Protocol):
    """A transaction that runs a group's reads and writes its own way (see the module
    docstring)."""

    def states_and_effects_get(
        self, agent: str, resources: Sequence[Scoped], consumer: str, keys: Sequence[Scoped]
    ) -> tuple[dict[Scoped, bytes | None], dict[Scoped, list[StoredOutput] | None]]:
        """``states_get(agent, resources)`` and ``effects_get(consumer, keys)`` at once."""
        ...

    def effects_put_with_commit(
        self, consumer: str, effects: Sequence[NewEffect], marks: Sequence[Scoped]
    ) -> None:
        """``effects_put`` and ``effects_mark_published``, sent with the COMMIT: a key
        stored meanwhile surfaces as ``DuplicateEffect`` at the latest from the commit."""
        ...

    def append_log(
        self, agent: str, scope: Scope, events: Sequence[NewEvent],
        states: Sequence[tuple[str, bytes, int]],
    ) -> None:  # fmt: skip
        """Append ``events``; store each ``(resource_id, data, index)`` state at the position
        of ``events[index]``. Errors may surface only at the commit."""
        ...


def _tails(tx: Transaction) -> TypeGuard[LogTail]:
    """``isinstance(tx, LogTail)``, asked once a class: checking a runtime protocol looks
    at each of its methods, three times a group."""
    return _tailing(type(tx))


@cache
def _tailing(kind: type) -> bool:
    return issubclass(kind, LogTail)


def read_group(
    tx: Transaction, agent: str, resources: Sequence[Scoped], consumer: str, keys: Sequence[Scoped]
) -> tuple[dict[Scoped, bytes | None], dict[Scoped, list[StoredOutput] | None]]:
    """Lock and read the agent's ``resources`` (``states_get``), then read the effects
    stored for ``keys`` (``effects_get``)."""
    if _tails(tx):
        return tx.states_and_effects_get(agent, resources, consumer, keys)
    return tx.states_get(agent, resources), tx.effects_get(consumer, keys)


def store_effects(
    tx: Transaction, consumer: str, effects: Sequence[NewEffect], marks: Sequence[Scoped]
) -> None:
    """Store ``effects`` (a key already stored is a ``StoreError(kind="duplicate")``, raised
    at the latest by the commit) and mark the ``marks`` keys published."""
    if _tails(tx):
        tx.effects_put_with_commit(consumer, effects, marks)
        return
    tx.effects_put(consumer, effects)
    tx.effects_mark_published(consumer, marks)


def append_with_states(
    tx: Transaction, agent: str, scope: Scope, events: Sequence[NewEvent],
    states: Mapping[str, bytes],
) -> None:  # fmt: skip
    """Append ``events`` to the (scope, agent) log and store ``states`` (by resource id),
    each at the position of its resource's last event among ``events``."""
    if not events:
        return
    last = {e.resource_id or "": index for index, e in enumerate(events)}
    rows = [
        (resource, states[resource], index)
        for resource, index in last.items()
        if resource in states
    ]
    if _tails(tx):
        tx.append_log(agent, scope, events, rows)
        return
    positions = tx.events_append(agent, events, scope=scope)
    tx.states_put(agent, [NewState(r, data, positions[i], scope) for r, data, i in rows])
