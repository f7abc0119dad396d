"""Conformance: the batch methods (many states and effects per statement), on both backends.

Each batch method must agree with its single-row form, keep two tenants apart, and fail a
duplicate or an unstorable value the way a caller can classify.
"""

from __future__ import annotations

import threading

import pytest

from meshforge.errors import StoreError
from meshforge.store import NewEffect, NewState, Store, StoredOutput, open_store
from meshforge.topology.scope import DEFAULT_SCOPE, Scope

A = Scope("tenantA", "demo")
B = Scope("tenantB", "demo")
AGENT, CONSUMER = "order", "order_consumer"


def out(position: int, msg_id: str) -> StoredOutput:
    return StoredOutput(position, "evt.tenantA.demo.order.created", msg_id, b"\x00{}", {"h": "v"})


def test_states_get_returns_every_resource_asked_and_agrees_with_state_get(store: Store) -> None:
    with store.transaction() as tx:
        tx.state_put(AGENT, "o-1", b"one", 1, scope=A)
        tx.state_put(AGENT, "o-2", b"two", 2, scope=A)
        tx.state_put("other", "o-3", b"not mine", 1, scope=A)
    asked = [(A, "o-2"), (A, "o-1"), (A, "o-3"), (A, "o-1")]
    with store.transaction() as tx:
        states = tx.states_get(AGENT, asked)
        assert states == {(A, "o-1"): b"one", (A, "o-2"): b"two", (A, "o-3"): None}
        assert states == {key: tx.state_get(AGENT, key[1], scope=key[0]) for key in asked}
        assert tx.states_get(AGENT, []) == {}


def test_two_tenants_with_one_resource_id_are_two_states(store: Store) -> None:
    with store.transaction() as tx:
        tx.states_put(AGENT, [NewState("o-1", b"A", 1, A), NewState("o-1", b"B", 7, B)])
    with store.transaction() as tx:
        assert tx.states_get(AGENT, [(A, "o-1"), (B, "o-1"), (DEFAULT_SCOPE, "o-1")]) == {
            (A, "o-1"): b"A",
            (B, "o-1"): b"B",
            (DEFAULT_SCOPE, "o-1"): None,
        }
        tx.states_put(AGENT, [NewState("o-1", b"B2", 8, B)])
    with store.transaction() as tx:
        assert tx.state_get(AGENT, "o-1", scope=A) == b"A"
        assert tx.state_get(AGENT, "o-1", scope=B) == b"B2"


def test_states_put_keeps_the_last_of_one_resource_given_twice(store: Store) -> None:
    with store.transaction() as tx:
        tx.states_put(AGENT, [NewState("o-1", b"first", 1, A), NewState("o-1", b"last", 2, A)])
    with store.transaction() as tx:
        assert tx.states_get(AGENT, [(A, "o-1")]) == {(A, "o-1"): b"last"}


def test_batches_past_the_parameter_limit_are_chunked(store: Store) -> None:
    ids = [f"o-{n}" for n in range(1500)]  # past SQLite's 999 and the 500-row chunks
    with store.transaction() as tx:
        tx.states_put(AGENT, [NewState(r, r.encode(), 1, A) for r in ids])
        tx.effects_put(CONSUMER, [NewEffect(r, "c", [out(0, r)], A) for r in ids])
    with store.transaction() as tx:
        states = tx.states_get(AGENT, [(A, r) for r in ids])
        assert all(states[(A, r)] == r.encode() for r in ids)
        stored = tx.effects_get(CONSUMER, [(A, r) for r in ids])
        assert all([o.msg_id for o in stored[(A, r)] or []] == [r] for r in ids)
        assert tx.effects_mark_published(CONSUMER, [(A, r) for r in ids]) == len(ids)


def test_effects_round_trip_with_their_outputs_in_order(store: Store) -> None:
    with store.transaction() as tx:
        tx.effects_put(
            CONSUMER,
            [
                NewEffect("k-1", "c-1", [out(1, "m-2"), out(0, "m-1")], A),
                NewEffect("k-2", "c-2", [], A),  # processed, nothing to publish
            ],
        )
    with store.transaction() as tx:
        stored = tx.effects_get(CONSUMER, [(A, "k-1"), (A, "k-2"), (A, "k-3")])
        assert stored[(A, "k-1")] == [out(0, "m-1"), out(1, "m-2")]
        assert stored[(A, "k-2")] == []
        assert stored[(A, "k-3")] is None
        assert stored[(A, "k-1")] == tx.effect_get(CONSUMER, "k-1", scope=A)
        assert tx.effects_get("another_consumer", [(A, "k-1")]) == {(A, "k-1"): None}


def test_two_tenants_with_one_key_are_two_effects(store: Store) -> None:
    with store.transaction() as tx:
        tx.effects_put(CONSUMER, [NewEffect("k-1", "c-A", [out(0, "m-A")], A)])
        assert tx.effects_get(CONSUMER, [(B, "k-1")]) == {(B, "k-1"): None}
        tx.effects_put(CONSUMER, [NewEffect("k-1", "c-B", [out(0, "m-B")], B)])
        assert tx.effects_mark_published(CONSUMER, [(B, "k-1")]) == 1
    with store.transaction() as tx:
        stored = tx.effects_get(CONSUMER, [(A, "k-1"), (B, "k-1")])
        assert [o.msg_id for o in stored[(A, "k-1")] or []] == ["m-A"]
        assert [o.msg_id for o in stored[(B, "k-1")] or []] == ["m-B"]
    published = {r.scope: r.published_at for r in store.effects_read(CONSUMER)}
    assert published[A] is None and published[B] is not None


@pytest.mark.parametrize("twice_in_one_call", [False, True])
def test_a_duplicate_effect_is_named_and_stores_nothing(
    store: Store, twice_in_one_call: bool
) -> None:
    if not twice_in_one_call:
        with store.transaction() as tx:
            tx.effect_put(CONSUMER, "k-2", "c-old", [out(0, "m-old")], scope=A)
    batch = [
        NewEffect("k-1", "c-1", [out(0, "m-1")], A),
        NewEffect("k-2", "c-2", [out(0, "m-2")], A),
    ]
    if twice_in_one_call:
        batch.append(NewEffect("k-2", "c-3", [], A))
    with pytest.raises(StoreError) as caught, store.transaction() as tx:
        tx.effects_put(CONSUMER, batch)
    assert caught.value.kind == "duplicate" and not caught.value.retriable
    assert "k-2" in str(caught.value) and "tenantA" in str(caught.value)
    with store.transaction() as tx:
        stored = tx.effects_get(CONSUMER, [(A, "k-1"), (A, "k-2")])
    assert stored[(A, "k-1")] is None  # rolled back with the duplicate
    expected = None if twice_in_one_call else ["m-old"]
    assert (
        None if stored[(A, "k-2")] is None else [o.msg_id for o in stored[(A, "k-2")] or []]
    ) == expected


def test_a_duplicate_deep_in_a_big_batch_is_named_and_the_batch_stores_nothing(
    store: Store,
) -> None:
    # 1,100 rows go in several statements (chunks, then powers of two on SQLite): the key
    # stored before sits in a late one, after statements that stored their rows.
    with store.transaction() as tx:
        tx.effect_put(CONSUMER, "k-1050", "c-old", [out(0, "m-old")], scope=A)
    batch = [NewEffect(f"k-{n}", f"c-{n}", [out(0, f"m-{n}")], A) for n in range(1100)]
    with pytest.raises(StoreError) as caught, store.transaction() as tx:
        tx.effects_put(CONSUMER, batch)
    assert caught.value.kind == "duplicate" and "k-1050" in str(caught.value)
    assert [(e.key, e.command_id) for e in store.effects_read(CONSUMER)] == [("k-1050", "c-old")]


def test_mark_published_counts_only_stored_keys(store: Store) -> None:
    with store.transaction() as tx:
        tx.effects_put(CONSUMER, [NewEffect("k-1", "c-1", [], A), NewEffect("k-2", "c-2", [], A)])
    with store.transaction() as tx:
        # k-3 was never stored (or retention deleted it): passed over, nothing fails.
        assert tx.effects_mark_published(CONSUMER, [(A, "k-1"), (A, "k-3"), (B, "k-2")]) == 1
        assert tx.effects_mark_published(CONSUMER, []) == 0
    published = {r.key: r.published_at is not None for r in store.effects_read(CONSUMER)}
    assert published == {"k-1": True, "k-2": False}


def test_batch_and_single_row_writes_read_back_alike(store: Store) -> None:
    with store.transaction() as tx:
        tx.state_put(AGENT, "o-1", b"single", 1, scope=A)
        tx.effect_put(CONSUMER, "k-1", "c-1", [out(0, "m-1")], scope=A)
        tx.states_put(AGENT, [NewState("o-2", b"batch", 2, A)])
        tx.effects_put(CONSUMER, [NewEffect("k-2", "c-2", [out(0, "m-2")], A)])
    with store.transaction() as tx:
        assert tx.state_get(AGENT, "o-2", scope=A) == b"batch"
        assert [o.msg_id for o in tx.effect_get(CONSUMER, "k-2", scope=A) or []] == ["m-2"]
        assert tx.states_get(AGENT, [(A, "o-1")]) == {(A, "o-1"): b"single"}
        assert tx.effects_get(CONSUMER, [(A, "k-1")]) == {(A, "k-1"): [out(0, "m-1")]}
    with pytest.raises(StoreError) as caught, store.transaction() as tx:
        tx.effect_put(CONSUMER, "k-2", "c-2", [], scope=A)
    assert caught.value.kind == "duplicate"


def test_nul_in_a_key_is_a_deterministic_error_on_postgresql(pg_store: Store) -> None:
    for attempt in (
        lambda tx: tx.states_get(AGENT, [(A, "o-1"), (A, "o\x00-2")]),
        lambda tx: tx.effects_get(CONSUMER, [(A, "k\x00")]),
        lambda tx: tx.effects_put(CONSUMER, [NewEffect("k\x00", "c-1", [], A)]),
        lambda tx: tx.states_put(AGENT, [NewState("o\x00", b"x", 1, Scope("t\x00", "demo"))]),
        lambda tx: tx.effects_mark_published(CONSUMER, [(A, "k\x00")]),
    ):
        with pytest.raises(StoreError) as caught, pg_store.transaction() as tx:
            attempt(tx)
        # Not retriable, kind "invalid": a caller dead-letters the one message, not the batch.
        assert caught.value.kind == "invalid" and not caught.value.retriable, caught.value
        assert "NUL" in str(caught.value)
    with pg_store.transaction() as tx:
        assert tx.states_get(AGENT, [(A, "o-1")]) == {(A, "o-1"): None}


def test_unencodable_text_is_a_deterministic_error(store: Store) -> None:
    """A lone surrogate cannot be sent to either database, in a batch read or a COPY."""
    for attempt in (
        lambda tx: tx.states_get(AGENT, [(A, "o-\ud800")]),
        lambda tx: tx.effects_put(CONSUMER, [NewEffect("k-\ud800", "c-1", [], A)]),
    ):
        with pytest.raises(StoreError) as caught, store.transaction() as tx:
            attempt(tx)
        assert caught.value.kind == "invalid" and not caught.value.retriable, caught.value


def test_nul_in_a_key_round_trips_on_sqlite(sqlite_store: Store) -> None:
    with sqlite_store.transaction() as tx:
        tx.states_put(AGENT, [NewState("o\x00-1", b"x", 1, A)])
        tx.effects_put(CONSUMER, [NewEffect("k\x00", "c-1", [out(0, "m\x00")], A)])
    with sqlite_store.transaction() as tx:
        assert tx.states_get(AGENT, [(A, "o\x00-1"), (A, "o")]) == {
            (A, "o\x00-1"): b"x",
            (A, "o"): None,
        }
        assert [o.msg_id for o in tx.effects_get(CONSUMER, [(A, "k\x00")])[(A, "k\x00")] or []] == [
            "m\x00"
        ]


def test_overlapping_batches_take_turns_without_deadlock(pg_store: Store) -> None:
    """Two workers lock overlapping resources, given in opposite orders, many times over."""
    ids = [f"o-{n}" for n in range(40)]
    errors: list[BaseException] = []

    def worker(order: list[str]) -> None:
        try:
            for round_ in range(15):
                with pg_store.transaction() as tx:
                    states = tx.states_get(AGENT, [(A, r) for r in order])
                    counts = {k: int(v or b"0") for k, v in states.items()}
                    tx.states_put(
                        AGENT,
                        [NewState(r, str(counts[(A, r)] + 1).encode(), round_, A) for r in order],
                    )
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)

    threads = [
        threading.Thread(target=worker, args=(ids,)),
        threading.Thread(target=worker, args=(list(reversed(ids)),)),
        threading.Thread(target=worker, args=(ids[::2],)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []  # a deadlock would surface here as StoreError(kind="conflict")
    with pg_store.transaction() as tx:
        final = tx.states_get(AGENT, [(A, r) for r in ids])
    # No lost update: every increment of every worker is there.
    assert all(
        final[(A, r)] == str(30 + (15 if n % 2 == 0 else 0)).encode() for n, r in enumerate(ids)
    )


def test_postgresql_batch_reads_never_keep_a_cached_plan(pg_schema_url: str) -> None:
    """A plan cached while the tables were empty (a seq scan) must not outlive their growth."""
    with open_store(pg_schema_url + "&pool_size=1") as store:
        for _ in range(8):  # past psycopg's prepare threshold (5)
            with store.transaction() as tx:
                tx.states_get(AGENT, [(A, "o-1")])
                tx.effects_get(CONSUMER, [(A, "k-1")])
                tx.effects_mark_published(CONSUMER, [(A, "k-1")])
        with store.transaction() as tx:
            cached = [row[0] for row in tx.execute("SELECT statement FROM pg_prepared_statements")]
    assert not [sql for sql in cached if "unnest" in sql and "JOIN" in sql.upper()], cached


def test_postgresql_url_options_with_spaces_reach_the_server(pg_schema_url: str) -> None:
    with (
        open_store(pg_schema_url + "&options=-c%20work_mem%3D7MB") as store,
        store.transaction() as tx,
    ):
        assert tx.execute("SHOW work_mem") == [("7MB",)]
