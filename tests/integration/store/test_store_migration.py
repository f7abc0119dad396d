"""Schema 2 moves a schema-1 store's rows to the tenant their subjects name, on both backends."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from meshforge.demo import OrderAgent
from meshforge.runtime.outputs import stored_event
from meshforge.runtime.replay import replay, state_hash
from meshforge.store import StoredEvent, open_store
from meshforge.store import schema as schema_module
from meshforge.topology.scope import DEFAULT_SCOPE, Scope

A = Scope("tenantA", "demo")
B = Scope("tenantB", "demo")
TS = "2026-01-01T12:00:00.000000Z"
AGENT = OrderAgent()
# (old global position, event id, order id, scope its output's subject names; None: the
# effect was removed by retention, so nothing names it)
EVENTS = [(1, "e1", "o-1", A), (2, "e2", "o-1", B), (3, "e3", "o-3", A), (4, "e4", "o-9", None)]
# Snapshots as the old store had them: o-1 is tenantB's (its last event), the rest theirs.
STATES = [("o-1", 2), ("o-3", 3), ("o-9", 4)]


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store URL nothing has been created at yet."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'old.db'}"
        return
    database: str = request.getfixturevalue("pg_database")
    schema = "mig_" + "".join(c for c in tmp_path.name.lower() if c.isalnum())[-30:]
    yield f"{database}?schema={schema}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def payload(order_id: str) -> bytes:
    return json.dumps({"order_id": order_id, "qty": 1, "sku": "s-1"}).encode()


def snapshot(order_id: str) -> bytes:
    created = stored_event(AGENT, "order.created", payload(order_id))  # as replay reads it
    return AGENT.encode_state(AGENT.apply(AGENT.initial(), created))


def old_rows(stamp: Any) -> list[tuple[str, tuple[Any, ...]]]:
    """The rows the schema-1 runtime wrote for EVENTS, STATES and three inbox messages."""
    rows: list[tuple[str, tuple[Any, ...]]] = []
    for position, event_id, order_id, scope in EVENTS:
        rows.append((
            "INSERT INTO meshforge_events (agent, position, event_id, type, resource_id,"
            " command_id, key, data, ts, stored_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            ("order", position, event_id, "order.created", order_id, f"c-{event_id}",
             f"k-{event_id}", payload(order_id), TS, stamp),
        ))  # fmt: skip
        if scope is None:
            continue
        rows.append((
            "INSERT INTO meshforge_effects (consumer, key, command_id, created_at)"
            " VALUES (?, ?, ?, ?)", ("order_consumer", f"k-{event_id}", f"c-{event_id}", stamp),
        ))  # fmt: skip
        rows.append((
            "INSERT INTO meshforge_effect_outputs (consumer, key, position, subject, msg_id,"
            " data, headers) VALUES (?, ?, ?, ?, ?, ?, ?)",
            ("order_consumer", f"k-{event_id}", 0,
             f"evt.{scope.tenant}.{scope.namespace}.order.created", event_id, b"{}", "{}"),
        ))  # fmt: skip
    rows.append(("INSERT INTO meshforge_agent_heads (agent, position) VALUES ('order', 4)", ()))
    for order_id, position in STATES:
        rows.append((
            "INSERT INTO meshforge_states (agent, resource_id, data, position, updated_at)"
            " VALUES (?, ?, ?, ?, ?)", ("order", order_id, snapshot(order_id), position, stamp),
        ))  # fmt: skip
    for key, subject, headers in (
        ("i-1", "cmd.tenantA.demo.order.create", "{}"),
        ("i-2", None, json.dumps({"Tenant-Id": "tenantB"})),
        ("i-3", None, "{}"),
    ):
        rows.append((
            "INSERT INTO meshforge_inbox (key, consumer, subject, status, headers, received_at,"
            " created_at, updated_at) VALUES (?, ?, ?, 'processed', ?, ?, ?, ?)",
            (key, "order_consumer", subject, headers, stamp, stamp, stamp),
        ))  # fmt: skip
    return rows


def make_schema_1_store(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(schema_module, "MIGRATIONS", schema_module.MIGRATIONS[:1])
        patch.setattr(schema_module, "LATEST", 1)
        with open_store(url) as store, store.transaction() as tx:
            stamp = TS if store.dialect == "sqlite" else "2026-01-01T12:00:00Z"
            for sql, params in old_rows(stamp):
                tx.execute(sql, params)


def as_read(event_id: str, scope: Scope) -> StoredEvent:
    """The event as a reader returns it (position and time do not enter the hash)."""
    _, _, order_id, _ = next(e for e in EVENTS if e[1] == event_id)
    return StoredEvent(event_id, "order.created", order_id, f"c-{event_id}", f"k-{event_id}",
                       payload(order_id), TS, "order", 0, None, scope)  # type: ignore[arg-type]  # fmt: skip


def test_schema_1_rows_move_to_the_tenant_their_subjects_name(
    fresh_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_schema_1_store(fresh_url, monkeypatch)
    with open_store(fresh_url) as store:
        assert store.logs("order") == [(DEFAULT_SCOPE, "order"), (A, "order"), (B, "order")]
        logs = {
            scope: [
                (e.position, e.event_id, e.resource_id)
                for e in store.events_read("order", scope=scope)
            ]
            for scope, _ in store.logs("order")
        }
        assert logs == {
            A: [(1, "e1", "o-1"), (2, "e3", "o-3")],
            B: [(1, "e2", "o-1")],
            DEFAULT_SCOPE: [(1, "e4", "o-9")],
        }
        with store.transaction() as tx:
            states = tx.execute(
                "SELECT tenant, namespace, resource_id, position FROM meshforge_states"
                " ORDER BY tenant, resource_id"
            )
            heads = tx.execute("SELECT tenant, position FROM meshforge_agent_heads ORDER BY tenant")
            assert tx.state_get("order", "o-3", scope=A) == snapshot("o-3")
            assert tx.state_get("order", "o-3") is None
        assert states == [
            ("default", "default", "o-9", 1),
            ("tenantA", "demo", "o-3", 2),
            ("tenantB", "demo", "o-1", 1),  # the snapshot follows its last event
        ]
        assert heads == [("default", 1), ("tenantA", 2), ("tenantB", 1)]
        effects = {(r.scope, r.key): [o.msg_id for o in r.outputs] for r in store.effects_read()}
        assert effects == {(A, "k-e1"): ["e1"], (B, "k-e2"): ["e2"], (A, "k-e3"): ["e3"]}
        assert {r.key: r.scope for r in store.inbox_read()} == {
            "i-1": A, "i-2": Scope("tenantB"), "i-3": DEFAULT_SCOPE,
        }  # fmt: skip

        # Each log hashes as its events did, in their old order, under their tenant.
        for scope, ids in ((A, ["e1", "e3"]), (B, ["e2"]), (DEFAULT_SCOPE, ["e4"])):
            expected = state_hash([as_read(i, scope) for i in ids])
            assert replay(store, "order", scope=scope).state_hash == expected
        result = replay(store, "order", AGENT)
        assert result.events == 4
        # o-1 was changed by both tenants before the upgrade: its one snapshot went to
        # tenantB, so replay flags tenantA's o-1 (and only it) for a rebuild.
        assert result.mismatched == ("tenantA/demo/o-1",)

        # The moved logs go on without a gap.
        with store.transaction() as tx:
            event = replace(as_read("e1", A), event_id="e5")
            assert tx.events_append("order", [event], scope=A) == [3]


# Schema 2 rows for schema 3: effects and their outputs in a table of their own.
V2_OUTPUTS = {
    (A, "c", "k-1"): [(1, b"\x00\xff second", {"Nats-Msg-Id": "m-1"}), (0, b"first", {})],
    (B, "c", "k-1"): [(0, b"other tenant", {"Tenant-Id": "tenantB"})],
    (A, "c", "k-2"): [],
    (DEFAULT_SCOPE, "d", "k-3"): [(p, b"x" * p, {"n": str(p)}) for p in range(3)],
}


def make_schema_2_store(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(schema_module, "MIGRATIONS", schema_module.MIGRATIONS[:2])
        patch.setattr(schema_module, "LATEST", 2)
        with open_store(url) as store, store.transaction() as tx:
            stamp = TS if store.dialect == "sqlite" else "2026-01-01T12:00:00Z"
            for (scope, consumer, key), outputs in V2_OUTPUTS.items():
                tx.execute(
                    "INSERT INTO meshforge_effects (tenant, namespace, consumer, key, command_id,"
                    " created_at, published_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (scope.tenant, scope.namespace, consumer, key, f"cmd-{key}", stamp,
                     stamp if consumer == "c" else None),
                )  # fmt: skip
                for position, data, headers in outputs:
                    tx.execute(
                        "INSERT INTO meshforge_effect_outputs (tenant, namespace, consumer, key,"
                        " position, subject, msg_id, data, headers) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (scope.tenant, scope.namespace, consumer, key, position, f"evt.{key}.{position}",
                         f"{key}-{position}", data, json.dumps(headers)),
                    )  # fmt: skip


def test_schema_2_outputs_move_into_their_effects_rows(
    fresh_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshforge.store import StoredOutput, packing

    make_schema_2_store(fresh_url, monkeypatch)
    monkeypatch.setattr(packing, "_PAGE", 2)  # an effect's outputs span pages of the move
    expected = {
        (scope, consumer, key): [
            StoredOutput(p, f"evt.{key}.{p}", f"{key}-{p}", data, headers)
            for p, data, headers in sorted(outputs)
        ]
        for (scope, consumer, key), outputs in V2_OUTPUTS.items()
    }
    with open_store(fresh_url) as store:
        read = {(r.scope, r.consumer, r.key): list(r.outputs) for r in store.effects_read()}
        assert read == expected
        published = {r.key: r.published_at is not None for r in store.effects_read("c")}
        assert published == {"k-1": True, "k-2": True}
        with store.transaction() as tx:
            assert tx.effect_get("c", "k-1", scope=A) == expected[(A, "c", "k-1")]
            assert tx.effect_get("c", "k-2", scope=A) == []
            assert tx.effect_get("c", "k-9", scope=A) is None
            got = tx.effects_get("d", [(DEFAULT_SCOPE, "k-3"), (DEFAULT_SCOPE, "k-4")])
            assert got == {
                (DEFAULT_SCOPE, "k-3"): expected[(DEFAULT_SCOPE, "d", "k-3")],
                (DEFAULT_SCOPE, "k-4"): None,
            }
            tables = (
                "SELECT name FROM sqlite_master WHERE type = 'table'"
                if store.dialect == "sqlite"
                else "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            )
            names = {r[0] for r in tx.execute(tables)}
            assert "meshforge_effect_outputs" not in names
            versions = tx.execute("SELECT version FROM meshforge_schema_version ORDER BY version")
        assert versions == [(1,), (2,), (3,), (4,)]
        # New effects are stored the new way beside the moved ones; retention takes both.
        with store.transaction() as tx:
            tx.effect_put(
                "c",
                "k-5",
                "cmd-5",
                [StoredOutput(0, "evt.k-5", "m-5", b"new", {"a": "b"})],
                scope=A,
            )
        assert [o.data for r in store.effects_read("c") if r.key == "k-5" for o in r.outputs] == [
            b"new"
        ]
        assert store.effects_cleanup(datetime(2026, 6, 1, tzinfo=UTC)) == 4
        assert [r.key for r in store.effects_read()] == ["k-5"]
