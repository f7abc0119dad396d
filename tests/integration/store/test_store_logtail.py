"""Conformance: the log's tail (events appended with the states they lead to), on both backends.

PostgreSQL sends it with the COMMIT, so its errors surface at the end of the transaction:
they must still roll back everything, and nothing may run after the tail.
"""

from __future__ import annotations

import pytest

from meshforge.errors import StoreError
from meshforge.scope import Scope
from meshforge.store import NewEvent, Store
from meshforge.store.base import Transaction
from meshforge.store.logtail import append_with_states

A = Scope("tenantA", "demo")
B = Scope("tenantB", "demo")
AGENT = "order"


def ev(event_id: str, resource: str | None) -> NewEvent:
    return NewEvent(event_id, "created", resource, f"cmd-{event_id}", f"k-{event_id}", b"\x00{}", "2026-01-01T00:00:00Z")


def positions(store: Store, scope: Scope) -> list[tuple[int, str]]:
    return [(e.position, e.event_id) for e in store.events_read(AGENT, scope=scope)]


def test_appends_are_gapless_and_states_sit_at_their_last_event(store: Store) -> None:
    with store.transaction() as tx:
        append_with_states(tx, AGENT, A, [ev("e1", "o-1"), ev("e2", "o-2"), ev("e3", "o-1")],
                           {"o-1": b"one", "o-2": b"two"})  # fmt: skip
        append_with_states(tx, AGENT, B, [ev("e4", "o-1")], {"o-1": b"b-one"})
    with store.transaction() as tx:
        append_with_states(tx, AGENT, A, [ev("e5", "o-2")], {"o-2": b"two again"})
        append_with_states(tx, AGENT, A, [], {})
    assert positions(store, A) == [(1, "e1"), (2, "e2"), (3, "e3"), (4, "e5")]
    assert positions(store, B) == [(1, "e4")]
    with store.transaction() as tx:
        assert tx.states_get(AGENT, [(A, "o-1"), (A, "o-2"), (B, "o-1")]) == {
            (A, "o-1"): b"one", (A, "o-2"): b"two again", (B, "o-1"): b"b-one",
        }  # fmt: skip
        stored = tx.execute(
            "SELECT resource_id, position FROM meshforge_states WHERE tenant = ? AND agent = ?",
            (A.tenant, AGENT),
        )
        assert dict(stored) == {"o-1": 3, "o-2": 4}
        # The next plain append follows the tail's positions.
        assert tx.events_append(AGENT, [ev("e6", "o-3")], scope=A) == [5]


def test_a_tail_that_fails_rolls_back_the_whole_transaction(store: Store) -> None:
    with store.transaction() as tx:
        append_with_states(tx, AGENT, A, [ev("e1", "o-1")], {"o-1": b"one"})
    with pytest.raises(StoreError) as failed, store.transaction() as tx:
        tx.state_put(AGENT, "o-9", b"nine", 0, scope=A)
        # The same event id twice in one log: refused, at the latest by the commit.
        append_with_states(tx, AGENT, A, [ev("e1", "o-2")], {"o-2": b"two"})
    assert failed.value.kind == "duplicate"
    assert positions(store, A) == [(1, "e1")]
    with store.transaction() as tx:
        assert tx.states_get(AGENT, [(A, "o-2"), (A, "o-9")]) == {(A, "o-2"): None, (A, "o-9"): None}
        # The head did not move: the log stays gapless.
        append_with_states(tx, AGENT, A, [ev("e2", "o-2")], {"o-2": b"two"})
    assert positions(store, A) == [(1, "e1"), (2, "e2")]


def test_nothing_but_appends_may_follow_the_tail_on_postgresql(pg_store: Store) -> None:
    def work(tx: Transaction) -> None:
        append_with_states(tx, AGENT, A, [ev("e1", "o-1")], {"o-1": b"one"})
        tx.effects_get("order_consumer", [(A, "k")])

    with pytest.raises(StoreError, match="nothing but further appends"), pg_store.transaction() as tx:
        work(tx)
    assert positions(pg_store, A) == []
