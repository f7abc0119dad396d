"""Conformance: what one transaction does, identically on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import uuid
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshforge.errors import StoreError
from meshforge.store import NewEvent, Store, StoredOutput, Transaction

AGENT = "order"
CONSUMER = "order_consumer"


def event(event_id: str | None = None, *, resource_id: str | None = "r1") -> NewEvent:
    return NewEvent(
        event_id=event_id or str(uuid.uuid4()),
        type="order.created",
        resource_id=resource_id,
        command_id="cmd-1",
        key="key-1",
        data=b'{"qty": 1}',
        ts="2026-01-01T12:00:00.000000Z",
    )


def output(position: int) -> StoredOutput:
    return StoredOutput(position, "evt.default.demo.order.created", f"m-{position}", b"{}", {})


def inbox_begin(tx: Transaction, key: str, deliveries: int = 1) -> str:
    record = tx.inbox_begin(
        key, CONSUMER, message_id=f"id-{key}", type="order.create",
        subject="cmd.default.demo.order.create", stream="MESHFORGE_COMMANDS",
        stream_seq=7, deliveries=deliveries, headers={"Nats-Msg-Id": f"id-{key}"},
        resource_type="order", resource_id="r1",
    )  # fmt: skip
    return record.status


def write_everything(tx: Transaction, key: str) -> None:
    tx.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, qty INTEGER)")
    tx.execute("INSERT INTO orders (id, qty) VALUES (?, ?)", (key, 3))
    tx.effect_put(CONSUMER, key, f"cmd-{key}", [output(0), output(1)])
    tx.events_append(AGENT, [event()])
    tx.state_put(AGENT, key, b"state", 1)
    tx.outbox_add(msg_id=f"out-{key}", subject="evt.x", data=b"d", headers={})


def test_commit_makes_every_write_visible(store: Store) -> None:
    with store.transaction() as tx:
        write_everything(tx, "a")
    with store.transaction() as tx:
        assert tx.execute("SELECT id, qty FROM orders") == [("a", 3)]
        assert tx.effect_get(CONSUMER, "a") == [output(0), output(1)]
        assert tx.state_get(AGENT, "a") == b"state"
    assert [e.position for e in store.events_read(AGENT)] == [1]
    assert store.outbox_depth() == 1


def test_exception_rolls_back_every_write(store: Store) -> None:
    with store.transaction() as tx:
        tx.execute("CREATE TABLE orders (id TEXT PRIMARY KEY, qty INTEGER)")
    with pytest.raises(RuntimeError, match="handler blew up"), store.transaction() as tx:
        write_everything(tx, "a")
        raise RuntimeError("handler blew up")
    with store.transaction() as tx:
        assert tx.execute("SELECT count(*) FROM orders") == [(0,)]
        assert tx.effect_get(CONSUMER, "a") is None
        assert tx.state_get(AGENT, "a") is None
        # The position counter rolled back too: the log stays gapless.
        assert tx.events_append(AGENT, [event()]) == [1]
    assert store.outbox_depth() == 0


def test_caught_store_error_still_rolls_back(store: Store) -> None:
    with store.transaction() as tx:
        tx.effect_put(CONSUMER, "k", "cmd", [])
    with pytest.raises(StoreError, match="rolled back"), store.transaction() as tx:
        tx.state_put(AGENT, "r", b"lost", 1)
        with pytest.raises(StoreError):
            tx.effect_put(CONSUMER, "k", "cmd", [])
    with store.transaction() as tx:
        assert tx.state_get(AGENT, "r") is None


def test_inbox_find_or_insert_tracks_status(store: Store) -> None:
    with store.transaction() as tx:
        assert inbox_begin(tx, "k1") == "processing"
        tx.inbox_failed("k1", CONSUMER, "ValueError: bad\nthing")
    with store.transaction() as tx:
        assert inbox_begin(tx, "k1", deliveries=2) == "processing"
        tx.inbox_done("k1", CONSUMER)
    with store.transaction() as tx:
        assert inbox_begin(tx, "k1", deliveries=3) == "processed"
    [record] = list(store.inbox_read(CONSUMER))
    assert (record.status, record.attempts, record.deliveries) == ("processed", 2, 2)
    assert record.processed and record.processed_at is not None and record.error is None
    assert record.failed_at is not None and record.headers == {"Nats-Msg-Id": "id-k1"}
    assert (record.stream, record.stream_seq, record.resource_id) == ("MESHFORGE_COMMANDS", 7, "r1")


def test_inbox_done_on_unknown_key_raises(store: Store) -> None:
    with pytest.raises(StoreError, match="no inbox row") as info, store.transaction() as tx:
        tx.inbox_done("missing", CONSUMER)
    assert info.value.kind == "not_found"


def test_effect_put_twice_is_refused(store: Store) -> None:
    with store.transaction() as tx:
        assert tx.effect_get(CONSUMER, "k") is None
        tx.effect_put(CONSUMER, "k", "cmd-1", [output(0)])
    with pytest.raises(StoreError, match="double the effect") as info, store.transaction() as tx:
        tx.effect_put(CONSUMER, "k", "cmd-2", [output(5)])
    assert info.value.kind == "duplicate" and not info.value.retriable
    with store.transaction() as tx:
        assert tx.effect_get(CONSUMER, "k") == [output(0)]
        assert tx.effect_get("other_consumer", "k") is None
        tx.effect_put("other_consumer", "k", "cmd-1", [])
        assert tx.effect_get("other_consumer", "k") == []
        tx.effect_mark_published(CONSUMER, "k")
    [record] = list(store.effects_read(CONSUMER))
    assert record.command_id == "cmd-1" and record.published_at is not None


_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))
_outputs = st.lists(
    st.builds(
        StoredOutput,
        position=st.integers(0, 2**31 - 1),
        subject=_text,
        msg_id=_text,
        data=st.binary(max_size=300),
        headers=st.dictionaries(st.text(), st.text(), max_size=5),
    ),
    max_size=6,
    unique_by=lambda o: o.position,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(outputs=_outputs)
def test_outputs_round_trip(store: Store, outputs: list[StoredOutput]) -> None:
    key = str(uuid.uuid4())
    with store.transaction() as tx:
        tx.effect_put(CONSUMER, key, "cmd", outputs)
    with store.transaction() as tx:
        assert tx.effect_get(CONSUMER, key) == sorted(outputs, key=lambda o: o.position)


def test_events_get_gapless_positions_under_concurrent_appends(store: Store) -> None:
    errors: list[BaseException] = []

    def append(worker: int) -> None:
        try:
            for i in range(15):
                batch = [event(f"w{worker}-{i}-{j}") for j in range(1 + (i % 3))]
                with store.transaction() as tx:
                    tx.events_append(f"agent{worker % 2}", batch)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=append, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for agent in ("agent0", "agent1"):
        stored = list(store.events_read(agent))
        assert [e.position for e in stored] == list(range(1, 3 * 30 + 1))
        assert len({e.event_id for e in stored}) == len(stored)
    assert store.agents() == ["agent0", "agent1"]


def test_duplicate_event_id_is_refused(store: Store) -> None:
    with store.transaction() as tx:
        assert tx.events_append(AGENT, [event("e1"), event("e2")]) == [1, 2]
    with pytest.raises(StoreError) as info, store.transaction() as tx:
        tx.events_append(AGENT, [event("e3"), event("e1")])
    assert info.value.kind == "duplicate"
    with store.transaction() as tx:
        assert tx.events_append("other", [event("e1")]) == [1]
        assert tx.events_append(AGENT, [event("e3")]) == [3]


def test_events_read_pages_after_and_limit(store: Store) -> None:
    with store.transaction() as tx:
        tx.events_append(AGENT, [event(f"e{i}", resource_id=None) for i in range(1, 11)])
    store.page_size = 3  # type: ignore[attr-defined]
    assert [e.position for e in store.events_read(AGENT, after=2, limit=5)] == [3, 4, 5, 6, 7]
    everything = list(store.events_read(AGENT))
    assert [e.event_id for e in everything] == [f"e{i}" for i in range(1, 11)]
    assert everything[0].agent == AGENT and everything[0].data == b'{"qty": 1}'
    assert everything[0].resource_id is None and everything[0].stored_at.tzinfo is not None
    assert list(store.events_read(AGENT, after=10)) == []
    assert list(store.events_read("nobody")) == []


def test_state_snapshots(store: Store) -> None:
    with store.transaction() as tx:
        assert tx.state_get(AGENT, "r1") is None
        tx.state_put(AGENT, "r1", b"v1", 1)
        tx.state_put(AGENT, "r1", b"v2", 2)
        tx.state_put("inventory", "r1", b"other", 1)
    with store.transaction() as tx:
        assert tx.state_get(AGENT, "r1") == b"v2"
        assert tx.state_get("inventory", "r1") == b"other"


def test_state_get_serialises_read_modify_write(store: Store) -> None:
    """Four workers increment one counter; a lost update would show as a short count."""

    def increment() -> None:
        for _ in range(10):
            with store.transaction() as tx:
                raw = tx.state_get("counter", "c")
                value = int(raw or b"0") + 1
                tx.state_put("counter", "c", str(value).encode(), value)

    threads = [threading.Thread(target=increment) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with store.transaction() as tx:
        assert tx.state_get("counter", "c") == b"40"


def test_node_epochs_and_replies(store: Store) -> None:
    with store.transaction() as tx:
        assert tx.node_epoch("lab1", "node7") is None
        assert [tx.node_epoch_bump("lab1", "node7") for _ in range(3)] == [1, 2, 3]
        assert tx.node_epoch_bump("lab1", "node8") == 1
        assert tx.node_reply_get("lab1", "node7", "c1") is None
        tx.node_reply_put("lab1", "node7", "c1", b"reply")
    with store.transaction() as tx:
        assert tx.node_epoch("lab1", "node7") == 3
        assert tx.node_reply_get("lab1", "node7", "c1") == b"reply"
        assert tx.node_reply_get("lab1", "node8", "c1") is None
    with pytest.raises(StoreError, match="already stored"), store.transaction() as tx:
        tx.node_reply_put("lab1", "node7", "c1", b"again")
    assert [(n.node, n.epoch) for n in store.nodes()] == [("node7", 3), ("node8", 1)]


def test_execute_uses_qmark_everywhere(store: Store) -> None:
    with store.transaction() as tx:
        tx.execute("CREATE TABLE notes (body TEXT, n INTEGER)")
        tx.execute("INSERT INTO notes VALUES (?, ?), ('what?', 2)", ("50% off", 1))
        rows = tx.execute("SELECT body, n FROM notes WHERE body LIKE '%off' OR n = ?", (2,))
        assert sorted(rows) == [("50% off", 1), ("what?", 2)]
        assert tx.execute("UPDATE notes SET n = n + 1") == []


def test_execute_error_is_a_store_error(store: Store) -> None:
    with pytest.raises(StoreError, match=f"{store.dialect} store"), store.transaction() as tx:
        tx.execute("SELECT * FROM no_such_table")


def test_run_retries_retriable_errors(store: Store) -> None:
    calls = Counter[str]()

    def work(tx: Transaction) -> int:
        calls["n"] += 1
        tx.state_put(AGENT, f"attempt{calls['n']}", b"x", 1)
        if calls["n"] < 3:
            raise StoreError("simulated conflict", kind="conflict", retriable=True)
        return calls["n"]

    assert store.run(work) == 3
    with store.transaction() as tx:
        assert tx.state_get(AGENT, "attempt1") is None
        assert tx.state_get(AGENT, "attempt3") == b"x"
    with pytest.raises(StoreError, match="not retriable"):
        store.run(lambda tx: (_ for _ in ()).throw(StoreError("not retriable")))
