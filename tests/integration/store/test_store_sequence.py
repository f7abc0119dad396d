"""Conformance: schema 5's logs (docs/STORE.md, "The layout written in sequence").

Effects are appended with a sequence and never changed; marking them published appends
runs of sequences, cut at multiples of 1,024, none covering a sequence another covers, the
run covering an effect giving its ``published_at``; retention deletes the runs that end before the oldest effect kept.
On SQLite, keys, event ids and resources are found by a 64-bit digest and compared with
the names themselves, so names sharing a digest stay apart (forced here by a digest that
is the same for every name).
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from meshforge.errors import StoreError
from meshforge.ops.probes import _EFFECTS_COUNT
from meshforge.store import NewEffect, NewEvent, NewState, Store, StoredOutput, sequencing
from meshforge.topology.scope import DEFAULT_SCOPE, Scope

if TYPE_CHECKING:
    from conftest import ManualClock

A = Scope("tenantA", "demo")
B = Scope("tenantB", "demo")
AGENT, CONSUMER = "order", "order_consumer"


def out(msg_id: str) -> StoredOutput:
    return StoredOutput(0, "evt.tenantA.demo.order.created", msg_id, b"\x00{}", {"h": "v"})


def event(event_id: str, resource_id: str = "o-1") -> NewEvent:
    return NewEvent(event_id, "order.created", resource_id, "cmd", "key", b"{}", "ts")


def put(store: Store, keys: list[str], scope: Scope = A) -> None:
    with store.transaction() as tx:
        tx.effects_put(CONSUMER, [NewEffect(k, f"c-{k}", [out(k)], scope) for k in keys])


def runs(store: Store) -> list[tuple[int, int]]:
    with store.transaction() as tx:
        rows = tx.execute(
            "SELECT first_seq, last_seq FROM meshforge_published ORDER BY first_seq, last_seq"
        )
    return [(int(a), int(b)) for a, b in rows]


def test_runs_are_cut_at_multiples_of_1024() -> None:
    assert sequencing.runs([]) == []
    assert sequencing.runs([5, 3, 4, 9, 1023, 1024, 1025, 4]) == [
        (3, 5), (9, 9), (1023, 1023), (1024, 1025),
    ]  # fmt: skip
    assert sequencing.runs(range(1, 3001)) == [(1, 1023), (1024, 2047), (2048, 3000)]


def test_a_mark_appends_runs_and_published_at_is_the_first_mark(
    store: Store, clock: ManualClock
) -> None:
    keys = [f"k-{n:04d}" for n in range(3000)]
    put(store, keys[:1500])
    put(store, keys[1500:])  # sequences 1 to 3,000 in the order stored
    first = clock.advance(1)
    with store.transaction() as tx:
        # Every other key of the first 100, then 2,800 in a row across two multiples.
        marked = keys[0:100:2] + keys[200:3000]
        assert tx.effects_mark_published(CONSUMER, [(A, k) for k in marked]) == 50 + 2800
    assert runs(store) == [
        *[(s, s) for s in range(1, 100, 2)], (201, 1023), (1024, 2047), (2048, 3000),
    ]  # fmt: skip
    second = clock.advance(1)
    with store.transaction() as tx:
        # Marked again with others: those keep their first time; one key is not stored.
        again = [(A, k) for k in keys[0:200]] + [(A, "k-none"), (B, keys[0])]
        assert tx.effects_mark_published(CONSUMER, again) == 200
    read = {r.key: r.published_at for r in store.effects_read(CONSUMER)}
    assert [r.key for r in store.effects_read(CONSUMER)] == keys  # in the order stored
    assert {k: read[k] for k in keys[0:4]} == {
        keys[0]: first, keys[1]: second, keys[2]: first, keys[3]: second
    }  # fmt: skip
    assert all(read[k] == first for k in keys[200:])
    with store.transaction() as tx:
        counted = dict(tx.execute(_EFFECTS_COUNT))
    assert {k: int(v) for k, v in counted.items()} == {"published": 3000}


def test_no_sequence_is_covered_twice_however_often_its_key_is_marked(store: Store) -> None:
    """What makes reading ``published_at`` one index step (``sequencing.PUBLISHED_AT``)."""
    keys = [f"k-{n:04d}" for n in range(1100)]
    put(store, keys)
    for marked in (keys[10:20], keys[0:30:3], keys[5:1100], keys, keys[1000:1050]):
        with store.transaction() as tx:
            tx.effects_mark_published(CONSUMER, [(A, k) for k in marked])
    covered = [s for first, last in runs(store) for s in range(first, last + 1)]
    assert sorted(covered) == list(range(1, 1101))  # each sequence once, none twice


def test_the_probe_reads_one_run_an_effect_on_a_light_loads_store(
    sqlite_store: Store, tmp_path: Path
) -> None:
    """A light load marks a few effects at a time: 1,024 sequences hold hundreds of runs.
    Counting what is published steps through one of them an effect (SQLite's virtual
    machine instructions counted), not through every run of the sequences before it."""
    for n in range(0, 3000, 3):
        keys = [f"k-{m}" for m in range(n, n + 3)]
        with sqlite_store.transaction() as tx:
            tx.effects_put(CONSUMER, [NewEffect(k, "c", [], A) for k in keys])
            tx.effects_mark_published(CONSUMER, [(A, k) for k in keys])
    put(sqlite_store, ["last"])  # one unpublished
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    with closing(sqlite3.connect(tmp_path / "store.db")) as db:
        db.set_progress_handler(count, 100)
        assert dict(db.execute(_EFFECTS_COUNT)) == {"published": 3000, "unpublished": 1}
    # About 40 instructions an effect (a forward scan: about 3,000), in hundreds.
    assert steps * 100 / 3001 < 200, f"{steps * 100 / 3001:.0f} instructions an effect"


def test_the_single_row_mark_and_the_probe_count(store: Store, clock: ManualClock) -> None:
    put(store, ["k-1", "k-2"])
    with store.transaction() as tx:
        tx.effect_mark_published(CONSUMER, "k-2", scope=A)
    with pytest.raises(StoreError) as missing, store.transaction() as tx:
        tx.effect_mark_published(CONSUMER, "k-3", scope=A)
    assert missing.value.kind == "not_found"
    assert {r.key: r.published_at for r in store.effects_read(CONSUMER)} == {
        "k-1": None, "k-2": clock.now,
    }  # fmt: skip
    with store.transaction() as tx:
        counted = {k: int(v) for k, v in tx.execute(_EFFECTS_COUNT)}
    assert counted == {"published": 1, "unpublished": 1}


def test_marking_and_reading_never_change_a_stored_effect(store: Store) -> None:
    put(store, [f"k-{n}" for n in range(10)])
    row_versions = (
        "SELECT seq, xmin::text FROM meshforge_effects ORDER BY seq"
        if store.dialect == "postgresql"
        else "SELECT seq, command_id FROM meshforge_effects ORDER BY seq"
    )
    with store.transaction() as tx:
        if store.dialect == "sqlite":
            tx.execute(
                "CREATE TRIGGER no_update BEFORE UPDATE ON meshforge_effects"
                " BEGIN SELECT RAISE(ABORT, 'an effect row was updated'); END"
            )
        before = tx.execute(row_versions)
    with store.transaction() as tx:
        assert tx.effects_mark_published(CONSUMER, [(A, f"k-{n}") for n in range(5)]) == 5
        tx.effect_mark_published(CONSUMER, "k-7", scope=A)
    with store.transaction() as tx:
        assert tx.execute(row_versions) == before  # PostgreSQL: no new row version
    assert runs(store) == [(1, 5), (8, 8)]


def test_retention_deletes_the_runs_before_the_oldest_effect_kept(
    store: Store, clock: ManualClock
) -> None:
    put(store, [f"old-{n}" for n in range(5)])
    cut = clock.advance(60)
    put(store, [f"new-{n}" for n in range(5)])
    with store.transaction() as tx:
        tx.effects_mark_published(CONSUMER, [(A, f"old-{n}") for n in (0, 1, 3)])
        tx.effects_mark_published(CONSUMER, [(A, "old-4"), (A, "new-0"), (A, "new-2")])
    assert runs(store) == [(1, 2), (4, 4), (5, 6), (8, 8)]
    assert store.effects_cleanup(cut) == 5
    assert runs(store) == [(5, 6), (8, 8)]  # (5, 6) covers new-0 still
    published = {r.key: r.published_at is not None for r in store.effects_read(CONSUMER)}
    assert published == {"new-0": True, "new-1": False, "new-2": True, "new-3": False,
                         "new-4": False}  # fmt: skip
    clock.advance(60)
    assert store.effects_cleanup(clock.now) == 5
    assert runs(store) == []
    # A sequence is never given again: a new effect is not covered by an old run.
    put(store, ["later"])
    with store.transaction() as tx:
        assert tx.execute("SELECT seq FROM meshforge_effects") == [(11,)]
    assert [r.published_at for r in store.effects_read()] == [None]


def test_effects_read_pages_in_the_order_stored_with_published_at(store: Store) -> None:
    store.page_size = 3  # type: ignore[attr-defined]
    for scope in (B, A, DEFAULT_SCOPE):
        put(store, [f"k-{n}" for n in (3, 1, 2, 0)], scope)
    with store.transaction() as tx:
        tx.effects_mark_published(CONSUMER, [(A, "k-1"), (DEFAULT_SCOPE, "k-0")])
    got = [(r.scope, r.key, r.published_at is not None) for r in store.effects_read()]
    assert got == [
        (scope, f"k-{n}", (scope, n) in ((A, 1), (DEFAULT_SCOPE, 0)))
        for scope in (B, A, DEFAULT_SCOPE)
        for n in (3, 1, 2, 0)
    ]
    assert [r.key for r in store.effects_read("nobody")] == []


@pytest.fixture
def one_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every name digests alike: each lookup finds every row of its table by digest."""
    monkeypatch.setattr(sequencing, "digests", lambda t, ns, owner, names: [7] * len(names))


@pytest.mark.usefixtures("one_digest")
def test_names_sharing_a_digest_are_told_apart(sqlite_store: Store) -> None:
    store = sqlite_store
    put(store, ["k-1", "k-2"])
    put(store, ["k-1"], B)
    with store.transaction() as tx:
        assert tx.execute("SELECT DISTINCT kd FROM meshforge_effects") == [(7,)]
        got = tx.effects_get(CONSUMER, [(A, "k-1"), (A, "k-2"), (A, "k-3"), (B, "k-2")])
        assert {k: None if v is None else v[0].msg_id for k, v in got.items()} == {
            (A, "k-1"): "k-1", (A, "k-2"): "k-2", (A, "k-3"): None, (B, "k-2"): None,
        }  # fmt: skip
        assert tx.effect_get(CONSUMER, "k-2", scope=B) is None
        put_more = [NewEffect("k-3", "c-3", [], A), NewEffect("k-2", "c-2", [], B)]
        tx.effects_put(CONSUMER, put_more)  # same digest, other names: stored
    for scope, key in ((A, "k-2"), (B, "k-1"), (A, "k-3")):
        with pytest.raises(StoreError) as refused, store.transaction() as tx:
            tx.effects_put(
                CONSUMER, [NewEffect("k-9", "c-9", [], A), NewEffect(key, "c", [], scope)]
            )
        assert refused.value.kind == "duplicate" and repr(key) in str(refused.value)
    with store.transaction() as tx:
        assert tx.effects_mark_published(CONSUMER, [(A, "k-2"), (A, "k-9")]) == 1
    published = {(r.scope, r.key): r.published_at is not None for r in store.effects_read()}
    assert published == {(A, "k-1"): False, (A, "k-2"): True, (B, "k-1"): False,
                         (A, "k-3"): False, (B, "k-2"): False}  # fmt: skip

    # Event ids: one log refuses its own ids only.
    with store.transaction() as tx:
        assert tx.events_append(AGENT, [event("e1"), event("e2")], scope=A) == [1, 2]
        assert tx.events_append(AGENT, [event("e1")], scope=B) == [1]
    for ids in (["e3", "e2"], ["e4", "e4"]):
        with pytest.raises(StoreError) as refused, store.transaction() as tx:
            tx.events_append(AGENT, [event(i) for i in ids], scope=A)
        assert refused.value.kind == "duplicate" and repr(ids[1]) in str(refused.value)
    with store.transaction() as tx:
        assert tx.events_append(AGENT, [event("e3")], scope=A) == [3]

    # Resources: each keeps its own row, changed in place.
    with store.transaction() as tx:
        tx.states_put(AGENT, [NewState("o-1", b"one", 1, A), NewState("o-2", b"two", 2, A)])
        tx.state_put(AGENT, "o-1", b"other", 1, scope=B)
    with store.transaction() as tx:
        assert tx.states_get(AGENT, [(A, "o-1"), (A, "o-2"), (A, "o-3"), (B, "o-2")]) == {
            (A, "o-1"): b"one", (A, "o-2"): b"two", (A, "o-3"): None, (B, "o-2"): None,
        }  # fmt: skip
        tx.states_put(AGENT, [NewState("o-2", b"two'", 3, A), NewState("o-3", b"three", 4, A)])
        tx.state_put(AGENT, "o-3", b"three'", 5, scope=A)  # stored by this transaction
    with store.transaction() as tx:
        rows = tx.execute(
            "SELECT tenant, resource_id, data, position FROM meshforge_states ORDER BY rowid"
        )
    assert rows == [
        ("tenantA", "o-1", b"one", 1), ("tenantA", "o-2", b"two'", 3),
        ("tenantB", "o-1", b"other", 1), ("tenantA", "o-3", b"three'", 5),
    ]  # fmt: skip


def test_a_key_stored_in_the_same_transaction_is_refused(store: Store) -> None:
    with pytest.raises(StoreError) as refused, store.transaction() as tx:
        assert tx.effects_get(CONSUMER, [(A, "k-1")]) == {(A, "k-1"): None}
        tx.effects_put(CONSUMER, [NewEffect("k-1", "c-1", [], A)])
        tx.effects_put(CONSUMER, [NewEffect("k-1", "c-2", [], A)])
    assert refused.value.kind == "duplicate"
    assert list(store.effects_read()) == []


def test_a_key_stored_by_the_callers_own_sql_is_refused(sqlite_store: Store) -> None:
    store = sqlite_store
    with pytest.raises(StoreError) as refused, store.transaction() as tx:
        assert tx.effects_get(CONSUMER, [(A, "k-1")]) == {(A, "k-1"): None}
        kd = sequencing.digest(A.tenant, A.namespace, CONSUMER, "k-1")
        tx.execute(
            "INSERT INTO meshforge_effects (tenant, namespace, consumer, key, kd, command_id,"
            " created_at, outputs) VALUES (?, ?, ?, ?, ?, 'c', 'now', x'')",
            (A.tenant, A.namespace, CONSUMER, "k-1", kd),
        )
        tx.effects_put(CONSUMER, [NewEffect("k-1", "c-1", [], A)])
    assert refused.value.kind == "duplicate"
