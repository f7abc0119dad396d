"""Conformance: an agent group's reads and its tail (effects, published marks, events
appended with the states they lead to), on both backends.

PostgreSQL sends the reads with the BEGIN and the tail with the COMMIT, so the tail's
errors surface at the end of the transaction: they must still roll back everything and
say what they say elsewhere, and nothing may run after the tail.
"""

from __future__ import annotations

import pytest

from meshforge.errors import StoreError
from meshforge.store import NewEvent, Store
from meshforge.store.base import NewEffect, NewState, StoredOutput, Transaction
from meshforge.store.logtail import DuplicateEffect, append_with_states, read_group, store_effects
from meshforge.topology.scope import Scope

A = Scope("tenantA", "demo")
B = Scope("tenantB", "demo")
AGENT = "order"


def ev(event_id: str, resource: str | None) -> NewEvent:
    return NewEvent(
        event_id,
        "created",
        resource,
        f"cmd-{event_id}",
        f"k-{event_id}",
        b"\x00{}",
        "2026-01-01T00:00:00Z",
    )


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
        assert tx.states_get(AGENT, [(A, "o-2"), (A, "o-9")]) == {
            (A, "o-2"): None,
            (A, "o-9"): None,
        }
        # The head did not move: the log stays gapless.
        append_with_states(tx, AGENT, A, [ev("e2", "o-2")], {"o-2": b"two"})
    assert positions(store, A) == [(1, "e1"), (2, "e2")]


def test_nothing_but_appends_may_follow_the_tail_on_postgresql(pg_store: Store) -> None:
    def work(tx: Transaction) -> None:
        append_with_states(tx, AGENT, A, [ev("e1", "o-1")], {"o-1": b"one"})
        tx.effects_get("order_consumer", [(A, "k")])

    with (
        pytest.raises(StoreError, match="nothing but further appends"),
        pg_store.transaction() as tx,
    ):
        work(tx)
    assert positions(pg_store, A) == []


CONSUMER = "order_consumer"


def effect(key: str, command_id: str) -> NewEffect:
    return NewEffect(
        key, command_id, [StoredOutput(0, "evt.t.ns.order.created", f"m-{key}", b"{}")], A
    )


def test_a_group_reads_what_states_get_and_effects_get_read(store: Store) -> None:
    with store.transaction() as tx:
        tx.states_put(AGENT, [NewState("o-1", b"one", 1, A)])
        tx.effects_put(CONSUMER, [effect("k1", "c1")])
    with store.transaction() as tx:
        states, stored = read_group(
            tx, AGENT, [(A, "o-1"), (A, "o-2"), (A, "o-1")], CONSUMER, [(A, "k1"), (A, "k2")]
        )
        assert states == {(A, "o-1"): b"one", (A, "o-2"): None}
        assert stored == {(A, "k1"): effect("k1", "c1").outputs, (A, "k2"): None}
        assert read_group(tx, AGENT, [], CONSUMER, []) == ({}, {})
        # Plain statements may follow the reads.
        tx.states_put(AGENT, [NewState("o-2", b"two", 2, A)])
    with store.transaction() as tx:
        assert tx.states_get(AGENT, [(A, "o-2")]) == {(A, "o-2"): b"two"}


def test_effects_and_marks_go_with_the_log_tail(store: Store) -> None:
    with store.transaction() as tx:
        store_effects(tx, CONSUMER, [effect("k1", "c1")], [])
    with store.transaction() as tx:
        read_group(tx, AGENT, [(A, "o-1")], CONSUMER, [(A, "k2")])
        store_effects(tx, CONSUMER, [effect("k2", "c2")], [(A, "k1")])
        append_with_states(tx, AGENT, A, [ev("e1", "o-1")], {"o-1": b"one"})
    published = {e.key: e.published_at is not None for e in store.effects_read(CONSUMER)}
    assert published == {"k1": True, "k2": False}
    assert positions(store, A) == [(1, "e1")]


def test_an_effect_key_stored_first_fails_the_group_as_a_duplicate(store: Store) -> None:
    with store.transaction() as tx:
        store_effects(tx, CONSUMER, [effect("k1", "c1")], [])
    with pytest.raises(StoreError) as failed, store.transaction() as tx:
        read_group(tx, AGENT, [(A, "o-1")], CONSUMER, [(A, "k2")])
        # k1 was stored by another transaction after this one read: found, at the latest, by the commit.
        store_effects(tx, CONSUMER, [effect("k2", "c2"), effect("k1", "c3")], [(A, "k1")])
        append_with_states(tx, AGENT, A, [ev("e1", "o-1")], {"o-1": b"one"})
    # What effects_put says, on every backend: the engine runs the group again.
    assert failed.value.kind == "duplicate"
    said = str(failed.value)
    assert (
        said.startswith(f"effects of consumer {CONSUMER!r}:")
        and "k1" in said
        and "already stored" in said
    )
    if store.dialect == "postgresql":
        assert isinstance(failed.value, DuplicateEffect)
    # Nothing of the group stayed: no effect, no mark, no event, no state.
    assert [(e.key, e.command_id, e.published_at) for e in store.effects_read(CONSUMER)] == [
        ("k1", "c1", None)
    ]
    assert positions(store, A) == []
    with store.transaction() as tx:
        assert tx.states_get(AGENT, [(A, "o-1")]) == {(A, "o-1"): None}


def test_a_duplicate_in_the_log_is_not_taken_for_a_duplicate_effect(pg_store: Store) -> None:
    with pg_store.transaction() as tx:
        append_with_states(tx, AGENT, A, [ev("e1", "o-1")], {"o-1": b"one"})
    with pytest.raises(StoreError) as failed, pg_store.transaction() as tx:
        store_effects(tx, CONSUMER, [effect("k1", "c1")], [])
        append_with_states(tx, AGENT, A, [ev("e1", "o-2")], {"o-2": b"two"})
    assert failed.value.kind == "duplicate" and not isinstance(failed.value, DuplicateEffect)
    assert list(pg_store.effects_read(CONSUMER)) == []


def test_a_failed_read_of_a_group_rolls_back_on_postgresql(pg_store: Store) -> None:
    with pytest.raises(StoreError) as failed, pg_store.transaction() as tx:
        tx.states_put(AGENT, [NewState("o-1", b"one", 1, A)])
        # Read the pipelined way only at the start; here the reads run one by one.
        read_group(tx, AGENT, [(A, "o-1")], CONSUMER, [(A, "k\x00")])
    assert failed.value.kind == "invalid"
    with pytest.raises(StoreError) as failed, pg_store.transaction() as tx:
        read_group(tx, AGENT, [(A, "o\x00")], CONSUMER, [(A, "k1")])
    assert failed.value.kind == "invalid"
    with pg_store.transaction() as tx:
        assert read_group(tx, AGENT, [(A, "o-1")], CONSUMER, [(A, "k1")]) == (
            {(A, "o-1"): None},
            {(A, "k1"): None},
        )
