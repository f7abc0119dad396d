"""The last writes of an agent's transaction: its events appended to the log, with the
states they lead to.

``append_with_states`` appends one scope's events to the log of (scope, agent) and stores
each resource's state at the position of that resource's last event. Any transaction
does it with ``events_append`` and ``states_put``. One that offers ``append_log``
(``LogTail``; PostgreSQL's) sends both in one statement together with the COMMIT: the
log's head row, which every writer of the log waits for until COMMIT, is then held only
while the server runs that statement and flushes the commit, never while the client
prepares its next statement. Nothing but further appends may follow it in the transaction.

Example (what the engine does last in a group's transaction)::

    append_with_states(tx, "order", scope, events, {"o-1": state_bytes})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from meshforge.scope import Scope
from meshforge.store.base import NewEvent, NewState, Transaction

__all__ = ["LogTail", "append_with_states"]


@runtime_checkable
class LogTail(Protocol):
    """A transaction that writes the log's tail its own way (see the module docstring)."""

    def append_log(
        self, agent: str, scope: Scope, events: Sequence[NewEvent],
        states: Sequence[tuple[str, bytes, int]],
    ) -> None:  # fmt: skip
        """Append ``events``; store each ``(resource_id, data, index)`` state at the position
        of ``events[index]``. Errors may surface only at the commit."""
        ...


def append_with_states(
    tx: Transaction, agent: str, scope: Scope, events: Sequence[NewEvent],
    states: Mapping[str, bytes],
) -> None:  # fmt: skip
    """Append ``events`` to the (scope, agent) log and store ``states`` (by resource id),
    each at the position of its resource's last event among ``events``."""
    if not events:
        return
    last = {e.resource_id or "": index for index, e in enumerate(events)}
    rows = [(resource, states[resource], index) for resource, index in last.items() if resource in states]
    if isinstance(tx, LogTail):
        tx.append_log(agent, scope, events, rows)
        return
    positions = tx.events_append(agent, events, scope=scope)
    tx.states_put(agent, [NewState(r, data, positions[i], scope) for r, data, i in rows])
