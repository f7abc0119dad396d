"""Conformance: the outbox relay's claims, leases, retries and cleanup, on both backends."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from meshforge.errors import StoreError
from meshforge.store import NewEvent, OutboxMessage, Store, StoredOutput, open_store

if TYPE_CHECKING:
    from conftest import ManualClock


def add(store: Store, count: int) -> list[int]:
    with store.transaction() as tx:
        return [
            tx.outbox_add(
                msg_id=f"m{i}", subject="evt.default.demo.order.created",
                data=f"payload {i}".encode(), headers={"Nats-Msg-Id": f"m{i}"},
            )
            for i in range(count)
        ]  # fmt: skip


def test_claim_leases_rows_in_id_order(store: Store) -> None:
    ids = add(store, 5)
    first = store.outbox_claim("relay-a", 3, lease_seconds=30)
    assert [r.id for r in first] == ids[:3]
    assert all(r.state == "publishing" and r.attempts == 0 for r in first)
    assert first[0].data == b"payload 0" and first[0].headers == {"Nats-Msg-Id": "m0"}
    assert [r.id for r in store.outbox_claim("relay-b", 10, lease_seconds=30)] == ids[3:]
    assert store.outbox_claim("relay-b", 10, lease_seconds=30) == []
    assert store.outbox_claim("relay-b", 0, lease_seconds=30) == []
    assert store.outbox_depth() == 5


def test_expired_lease_is_claimed_again(store: Store, clock: ManualClock) -> None:
    ids = add(store, 2)
    store.outbox_claim("relay-a", 10, lease_seconds=30)
    clock.advance(29)
    assert store.outbox_claim("relay-b", 10, lease_seconds=30) == []
    clock.advance(2)
    assert [r.id for r in store.outbox_claim("relay-b", 10, lease_seconds=30)] == ids


def test_sent_rows_leave_the_queue_and_are_cleaned_up(store: Store, clock: ManualClock) -> None:
    ids = add(store, 3)
    store.outbox_claim("relay", 10, lease_seconds=30)
    store.outbox_mark_sent(ids[:2])
    assert store.outbox_depth() == 1
    clock.advance(3600)
    assert [r.id for r in store.outbox_claim("relay", 10, lease_seconds=30)] == ids[2:]
    assert store.outbox_cleanup(clock.now - timedelta(seconds=10)) == 2
    assert store.outbox_cleanup(clock.now) == 0
    assert store.outbox_depth() == 1


def test_failed_rows_retry_when_due_until_given_up(store: Store, clock: ManualClock) -> None:
    [row_id] = add(store, 1)
    store.outbox_claim("relay", 10, lease_seconds=30)
    store.outbox_mark_failed(row_id, "PublishError: timeout", clock.now + timedelta(seconds=10))
    assert store.outbox_depth() == 1
    assert store.outbox_claim("relay", 10, lease_seconds=30) == []
    clock.advance(10)
    [again] = store.outbox_claim("relay", 10, lease_seconds=30)
    assert (again.id, again.attempts, again.state) == (row_id, 1, "publishing")
    store.outbox_mark_failed(row_id, "gone", clock.now, give_up=True)
    clock.advance(86400)
    assert store.outbox_claim("relay", 10, lease_seconds=30) == []
    assert store.outbox_depth() == 0
    with pytest.raises(StoreError, match="no outbox row with id 999"):
        store.outbox_mark_failed(999, "x", clock.now)


def test_concurrent_claimers_never_share_a_row(store: Store) -> None:
    ids = add(store, 240)
    claimed: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def relay(name: str) -> None:
        mine: list[int] = []
        try:
            while rows := store.outbox_claim(name, 7, lease_seconds=300):
                mine.extend(r.id for r in rows)
                store.outbox_mark_sent([r.id for r in rows])
        except BaseException as exc:
            errors.append(exc)
        claimed[name] = mine

    threads = [threading.Thread(target=relay, args=(f"relay-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    everything = [i for mine in claimed.values() for i in mine]
    assert sorted(everything) == ids
    assert store.outbox_depth() == 0


def test_claim_skips_rows_locked_by_another_relay(pg_store: Store) -> None:
    ids = add(pg_store, 3)
    with pg_store.transaction() as tx:
        tx.execute("SELECT id FROM meshforge_outbox WHERE id = ? FOR UPDATE", (ids[0],))
        # Another connection: must not wait for the lock held above.
        rows = pg_store.outbox_claim("relay-b", 10, lease_seconds=30)
        assert [r.id for r in rows] == ids[1:]
    assert [r.id for r in pg_store.outbox_claim("relay-c", 10, lease_seconds=30)] == ids[:1]


def test_readers_stream_page_by_page(store: Store) -> None:
    with store.transaction() as tx:
        for consumer in ("a_consumer", "b_consumer"):
            for k in range(5):
                outputs = [
                    StoredOutput(p, "evt.x", f"{consumer}{k}-{p}", b"d", {}) for p in range(k % 3)
                ]
                tx.effect_put(consumer, f"k{k}", f"cmd{k}", outputs)
                tx.inbox_begin(
                    f"k{k}", consumer, message_id=None, type=None, subject=None, stream=None,
                    stream_seq=None, deliveries=1, headers={},
                )  # fmt: skip
                if k % 2:
                    tx.inbox_done(f"k{k}", consumer)
    store.page_size = 2  # type: ignore[attr-defined]
    effects = list(store.effects_read())
    assert [(e.consumer, e.key) for e in effects] == [
        (c, f"k{k}") for c in ("a_consumer", "b_consumer") for k in range(5)
    ]
    assert [len(e.outputs) for e in effects] == [0, 1, 2, 0, 1] * 2
    assert [o.position for o in effects[2].outputs] == [0, 1]
    assert [e.key for e in store.effects_read("b_consumer")] == [f"k{k}" for k in range(5)]
    assert len(list(store.inbox_read())) == 10
    done = list(store.inbox_read("a_consumer", status="processed"))
    assert [r.key for r in done] == ["k1", "k3"]


def test_retention_cleanup_keeps_recent_and_in_flight(store: Store, clock: ManualClock) -> None:
    def begin(key: str) -> None:
        with store.transaction() as tx:
            tx.inbox_begin(
                key, "c", message_id=None, type=None, subject=None, stream=None,
                stream_seq=None, deliveries=1, headers={},
            )  # fmt: skip
            if key != "in-flight":
                tx.inbox_done(key, "c")
            tx.effect_put("c", key, "cmd", [])
            tx.events_append("a", [NewEvent(key, "t", None, "cmd", key, b"", "ts")])

    begin("old")
    begin("in-flight")
    clock.advance(7 * 86400)
    cutoff = clock.now
    clock.advance(1)
    begin("new")
    assert store.inbox_cleanup(cutoff) == 1
    assert sorted(r.key for r in store.inbox_read()) == ["in-flight", "new"]
    assert store.effects_cleanup(cutoff) == 2
    assert [e.key for e in store.effects_read()] == ["new"]
    assert len(list(store.events_read("a"))) == 3


def test_claim_marks_the_last_batch_sent_in_the_same_transaction(store: Store) -> None:
    ids = add(store, 6)
    first = store.outbox_claim("relay", 3, lease_seconds=30)
    second = store.outbox_claim("relay", 3, lease_seconds=30, mark_sent=[r.id for r in first])
    assert [r.id for r in second] == ids[3:]
    assert store.outbox_depth() == 3  # the first three are sent
    # Nothing left to claim (or no room): the marks are still stored.
    assert store.outbox_claim("relay", 0, lease_seconds=30, mark_sent=[ids[3]]) == []
    assert store.outbox_claim("relay", 10, lease_seconds=30, mark_sent=ids[4:]) == []
    assert store.outbox_depth() == 0


def test_outbox_add_many_returns_ids_in_order_and_rolls_back(store: Store) -> None:
    messages = [
        OutboxMessage(f"m{i}", "evt.default.demo.order.created", f"p{i}".encode(), {"n": str(i)})
        for i in range(250)
    ]
    with store.transaction() as tx:
        ids = tx.outbox_add_many(messages)
        assert tx.outbox_add_many([]) == []
    assert ids == sorted(ids) and len(set(ids)) == 250
    claimed = store.outbox_claim("relay", 500, lease_seconds=30)
    assert [(r.id, r.msg_id, r.data, r.headers) for r in claimed] == [
        (i, m.msg_id, m.data, m.headers) for i, m in zip(ids, messages, strict=True)
    ]
    with pytest.raises(RuntimeError), store.transaction() as tx:
        tx.outbox_add_many(messages[:3])
        raise RuntimeError("the caller's work failed")
    assert store.outbox_depth() == 250  # the three rolled back with it


def test_outbox_add_many_ids_match_rows_across_statements(store: Store) -> None:
    with store.transaction() as tx:
        first = tx.outbox_add_many([OutboxMessage("gone", "evt.default.demo.a.b", b"{}", {})])
        tx.execute("DELETE FROM meshforge_outbox")  # ids are never reused
    messages = [OutboxMessage(f"m{i}", "evt.default.demo.a.b", b"{}", {}) for i in range(1200)]
    with store.transaction() as tx:
        ids = tx.outbox_add_many(messages)  # more rows than one statement carries
    assert ids[0] > first[0] and ids == sorted(set(ids)) and len(ids) == 1200
    claimed = store.outbox_claim("relay", 2000, lease_seconds=30)
    assert [(r.id, r.msg_id) for r in claimed] == [
        (i, m.msg_id) for i, m in zip(ids, messages, strict=True)
    ]


def test_sqlite_relay_commits_leave_the_application_s_commits_full(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        with store.transaction() as tx:
            ids = tx.outbox_add_many([OutboxMessage("m", "evt.default.demo.a.b", b"{}", {})])
        assert [r.id for r in store.outbox_claim("relay", 10, lease_seconds=30)] == ids
        assert store.outbox_claim("relay", 10, lease_seconds=30, mark_sent=ids) == []
        with store.transaction() as tx:  # 2 = FULL: only the relay's own commits are NORMAL
            assert tx.execute("PRAGMA synchronous") == [(2,)]
    finally:
        store.close()
