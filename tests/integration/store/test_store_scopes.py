"""Conformance: two tenants keep apart in every table an agent uses, on both backends."""

from __future__ import annotations

import uuid

from meshforge.store import NewEvent, Store, StoredOutput, Transaction
from meshforge.store.base import InboxRecord
from meshforge.topology.scope import DEFAULT_SCOPE, Scope

A = Scope("tenantA", "demo")
B = Scope("tenantB", "demo")
AGENT, CONSUMER = "order", "order_consumer"


def event(event_id: str, resource_id: str = "o-1") -> NewEvent:
    return NewEvent(event_id, "order.created", resource_id, "cmd-1", "k-1", b'{"n": 1}',
                    "2026-01-01T12:00:00.000000Z")  # fmt: skip


def out(scope: Scope, msg_id: str) -> StoredOutput:
    return StoredOutput(0, f"evt.{scope.tenant}.{scope.namespace}.order.created", msg_id, b"{}", {})


def begin(tx: Transaction, scope: Scope, key: str = "k-1") -> InboxRecord:
    return tx.inbox_begin(
        key, CONSUMER, message_id=key, type="order.create",
        subject=f"cmd.{scope.tenant}.{scope.namespace}.order.create", stream="S", stream_seq=1,
        deliveries=1, headers={}, scope=scope,
    )  # fmt: skip


def test_one_resource_id_is_two_states(store: Store) -> None:
    with store.transaction() as tx:
        tx.state_put(AGENT, "o-1", b"A", 1, scope=A)
        assert tx.state_get(AGENT, "o-1", scope=B) is None
        assert tx.state_get(AGENT, "o-1") is None
        tx.state_put(AGENT, "o-1", b"B", 1, scope=B)
    with store.transaction() as tx:
        assert tx.state_get(AGENT, "o-1", scope=A) == b"A"
        assert tx.state_get(AGENT, "o-1", scope=B) == b"B"


def test_one_idempotency_key_is_two_effects(store: Store) -> None:
    with store.transaction() as tx:
        tx.effect_put(CONSUMER, "k-1", "c-A", [out(A, "m-A")], scope=A)
        assert tx.effect_get(CONSUMER, "k-1", scope=B) is None
        tx.effect_put(CONSUMER, "k-1", "c-B", [out(B, "m-B")], scope=B)
        tx.effect_mark_published(CONSUMER, "k-1", scope=B)
    with store.transaction() as tx:
        assert [o.msg_id for o in tx.effect_get(CONSUMER, "k-1", scope=A) or []] == ["m-A"]
        assert [o.msg_id for o in tx.effect_get(CONSUMER, "k-1", scope=B) or []] == ["m-B"]
    records = {r.scope: r for r in store.effects_read(CONSUMER)}
    assert set(records) == {A, B}
    assert records[A].published_at is None and records[B].published_at is not None
    assert [o.msg_id for o in records[B].outputs] == ["m-B"]


def test_effects_read_pages_across_scopes(store: Store) -> None:
    store.page_size = 3  # type: ignore[attr-defined]
    with store.transaction() as tx:
        for scope in (A, B, DEFAULT_SCOPE):
            for i in range(4):
                tx.effect_put(
                    CONSUMER, f"k-{i}", f"c-{i}", [out(scope, f"{scope}-{i}")], scope=scope
                )
    got = [(r.scope, r.key, r.outputs[0].msg_id) for r in store.effects_read()]
    assert len(got) == 12 and len(set(got)) == 12
    assert all(msg.startswith(str(scope)) for scope, _, msg in got)


def test_each_scope_has_its_own_gapless_log(store: Store) -> None:
    shared = str(uuid.uuid4())  # one event id in two tenants: neither is refused
    with store.transaction() as tx:
        assert tx.events_append(AGENT, [event(shared), event("a2")], scope=A) == [1, 2]
        assert tx.events_append(AGENT, [event(shared)], scope=B) == [1]
        assert tx.events_append(AGENT, [event("d1")]) == [1]
    assert [e.event_id for e in store.events_read(AGENT, scope=A)] == [shared, "a2"]
    assert [(e.event_id, e.scope) for e in store.events_read(AGENT, scope=B)] == [(shared, B)]
    assert [e.event_id for e in store.events_read(AGENT)] == ["d1"]
    assert store.logs() == [(DEFAULT_SCOPE, AGENT), (A, AGENT), (B, AGENT)]
    assert store.logs("inventory") == [] and store.agents() == [AGENT]


def test_one_inbox_key_is_two_rows(store: Store) -> None:
    with store.transaction() as tx:
        begin(tx, A)
        tx.inbox_done("k-1", CONSUMER, scope=A)
        assert not begin(tx, B).processed
        tx.inbox_failed("k-1", CONSUMER, "boom", scope=B)
        assert begin(tx, A).processed
    rows = {r.scope: r.status for r in store.inbox_read(CONSUMER)}
    assert rows == {A: "processed", B: "failed"}


def test_effects_cleanup_removes_every_scope(store: Store, clock: object) -> None:
    with store.transaction() as tx:
        tx.effect_put(CONSUMER, "k-1", "c", [out(A, "m-A")], scope=A)
        tx.effect_put(CONSUMER, "k-1", "c", [out(B, "m-B")], scope=B)
    clock.advance(10)  # type: ignore[attr-defined]
    assert store.effects_cleanup(clock.now) == 2  # type: ignore[attr-defined]
    assert list(store.effects_read()) == []
    with store.transaction() as tx:
        assert tx.execute("SELECT count(*) FROM meshforge_effects") == [(0,)]
