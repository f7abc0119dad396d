"""Migrations of older stores, on both backends: schema 2 moves a schema-1 store's rows to
the tenant their subjects name, schema 3 packs outputs into their effects, schema 5 makes
the effects and their publishing progress logs (and survives being killed part way)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from meshforge.demo import OrderAgent
from meshforge.errors import StoreError
from meshforge.runtime.outputs import stored_event
from meshforge.runtime.replay import replay, state_hash
from meshforge.store import StoredEvent, StoredOutput, open_store
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
    from meshforge.store import packing

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
        assert versions == [(1,), (2,), (3,), (4,), (5,)]
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


# Schema 4 rows for schema 5: effects of three scopes and two consumers, stored over time
# (two at a time share a created_at, so the old key orders them), most published by marks
# of a hundred at once (one of them across sequence 1,024), the rest not, and two
# published alone; the event logs and snapshots of two tenants.
V4_COUNT = 1300
V4_BASE = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def v4_time(seconds: float) -> datetime:
    return V4_BASE + timedelta(seconds=seconds)


def v4_stamp(at: datetime, dialect: str) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if dialect == "sqlite" else at.isoformat()


def v4_effects() -> list[tuple[Scope, str, str, datetime, datetime | None, list[StoredOutput]]]:
    """(scope, consumer, key, created_at, published_at, outputs) in the order stored."""
    scopes = (A, B, DEFAULT_SCOPE)
    rows = []
    for i in range(V4_COUNT):
        created = v4_time(i // 2)
        batch = i // 100
        if batch < 11 and batch != 5:
            published: datetime | None = v4_time(batch * 50 + 50.5)  # after its last effect
        elif i in (1200, 1250):
            published = v4_time(i + 0.25)
        else:
            published = None
        key = f"k-{(i * 7919) % V4_COUNT:05d}"  # not in the order stored
        outputs = [
            StoredOutput(
                p, f"evt.{key}.{p}", f"{key}-{p}", b"\x00" + key.encode() * p, {"p": str(p)}
            )
            for p in range(i % 3)
        ]
        rows.append((scopes[i % 3], "c" if i % 4 else "d", key, created, published, outputs))
    return rows


def v4_logs() -> list[tuple[Scope, str, str, int]]:
    """(scope, event id, order id, position) of the event logs of tenants A and B."""
    return [
        (scope, f"{scope.tenant}-e{n}", f"o-{n}", n)
        for scope in (A, B)
        for n in range(1, 6 if scope == A else 4)
    ]


def insert_rows(tx: Any, target: str, rows: list[tuple[Any, ...]]) -> None:
    for start in range(0, len(rows), 100):
        chunk = rows[start : start + 100]
        group = "(" + ", ".join("?" * len(chunk[0])) + ")"
        tx.execute(
            f"INSERT INTO {target} VALUES {', '.join([group] * len(chunk))}",
            [v for row in chunk for v in row],
        )


@contextmanager
def schema_4(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A context in which ``open_store`` knows schema versions 1 to 4 only."""
    with monkeypatch.context() as patch:
        patch.setattr(schema_module, "MIGRATIONS", schema_module.MIGRATIONS[:4])
        patch.setattr(schema_module, "LATEST", 4)
        yield


def make_schema_4_store(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshforge.store.packing import pack_outputs

    with schema_4(monkeypatch), open_store(url) as store, store.transaction() as tx:
        d = store.dialect
        insert_rows(
            tx,
            "meshforge_effects (tenant, namespace, consumer, key, command_id, created_at,"
            " published_at, outputs)",
            [
                (s.tenant, s.namespace, consumer, key, f"cmd-{key}", v4_stamp(created, d),
                 None if published is None else v4_stamp(published, d), pack_outputs(outputs))
                for s, consumer, key, created, published, outputs in v4_effects()
            ],
        )  # fmt: skip
        stamp = v4_stamp(V4_BASE, d)
        insert_rows(
            tx,
            "meshforge_events (tenant, namespace, agent, position, event_id, type, resource_id,"
            " command_id, key, data, ts, stored_at)",
            [
                (s.tenant, s.namespace, "order", position, event_id, "order.created", order_id,
                 f"c-{event_id}", f"k-{event_id}", payload(order_id), TS, stamp)
                for s, event_id, order_id, position in v4_logs()
            ],
        )  # fmt: skip
        heads: dict[Scope, int] = {}
        for s, _, _, position in v4_logs():
            heads[s] = max(heads.get(s, 0), position)
        insert_rows(
            tx,
            "meshforge_agent_heads (tenant, namespace, agent, position)",
            [(s.tenant, s.namespace, "order", p) for s, p in heads.items()],
        )
        insert_rows(
            tx,
            "meshforge_states (tenant, namespace, agent, resource_id, data, position, updated_at)",
            [
                (s.tenant, s.namespace, "order", order_id, snapshot(order_id), position, stamp)
                for s, _, order_id, position in v4_logs()
            ],
        )


def as_time(value: Any) -> datetime:
    at = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return at.astimezone(UTC)


_STATES = (
    "SELECT tenant, namespace, agent, resource_id, data, position, updated_at"
    " FROM meshforge_states ORDER BY tenant, namespace, agent, resource_id"
)


def read_schema_4(url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What the schema-4 store holds, read without the methods schema 5 changed."""
    from meshforge.store import EffectRecord
    from meshforge.store.packing import unpack_outputs

    with schema_4(monkeypatch), open_store(url) as store:
        with store.transaction() as tx:
            effects = [
                EffectRecord(r[2], r[3], r[4], tuple(unpack_outputs(r[7])), as_time(r[5]),
                             None if r[6] is None else as_time(r[6]), Scope(r[0], r[1]))
                for r in tx.execute(
                    "SELECT tenant, namespace, consumer, key, command_id, created_at,"
                    " published_at, outputs FROM meshforge_effects"
                )
            ]  # fmt: skip
            states = [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r)
                      for r in tx.execute(_STATES)]  # fmt: skip
            versions = tx.execute("SELECT max(version) FROM meshforge_schema_version")
        logs = {scope: list(store.events_read(agent, scope=scope)) for scope, agent in store.logs()}
        hashes = {scope: replay(store, "order", scope=scope).state_hash for scope in logs}
    assert versions == [(4,)]
    return {"effects": effects, "states": states, "logs": logs, "hashes": hashes}


def by_key(record: Any) -> tuple[Any, ...]:
    return (record.scope, record.consumer, record.key)


def check_schema_5(store: Any, before: dict[str, Any]) -> None:
    """The migrated store holds what the schema-4 one did, and dedupes every old key."""
    with store.transaction() as tx:
        assert tx.execute("SELECT version FROM meshforge_schema_version ORDER BY version") == [
            (1,), (2,), (3,), (4,), (5,)
        ]  # fmt: skip
        runs = tx.execute("SELECT first_seq, last_seq FROM meshforge_published")
        seqs = tx.execute("SELECT max(seq), count(*) FROM meshforge_effects")
        states = [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r)
                  for r in tx.execute(_STATES)]  # fmt: skip
    read = list(store.effects_read())
    # Identical rows, published_at included; in the order they were stored, numbered 1, 2, ...
    assert sorted(read, key=by_key) == sorted(before["effects"], key=by_key)
    assert [r.created_at for r in read] == sorted(r.created_at for r in read)
    assert seqs == [(V4_COUNT, V4_COUNT)]
    # Each mark of a hundred is one run, the one across 1,024 two; none crosses a multiple.
    assert all(first // 1024 == last // 1024 for first, last in runs)
    assert len(runs) == 10 + 1 + 2
    assert states == before["states"]
    for scope, events in before["logs"].items():
        assert list(store.events_read("order", scope=scope)) == events
        result = replay(store, "order", AGENT, scope=scope)
        assert result.state_hash == before["hashes"][scope] and result.consistent
    # Every old key is still stored, and storing it again is refused as a duplicate.
    keys = [(r.scope, r.consumer, r.key) for r in before["effects"]]
    with store.transaction() as tx:
        for consumer in ("c", "d"):
            found = tx.effects_get(consumer, [(s, k) for s, c, k in keys if c == consumer])
            assert None not in found.values()
    for scope, consumer, key in keys:
        with pytest.raises(StoreError) as refused, store.transaction() as tx:
            tx.effect_put(consumer, key, "again", [], scope=scope)
        assert refused.value.kind == "duplicate", key
    # The log goes on after the copied rows; a mark again keeps the first mark's time.
    old = next(
        r for r in before["effects"] if r.scope == A and r.consumer == "c" and r.published_at
    )
    with store.transaction() as tx:
        tx.effect_put("c", "k-new", "cmd-new", [], scope=A)
    with store.transaction() as tx:
        assert tx.effects_mark_published("c", [(A, "k-new"), (A, old.key)]) == 2
    again, last = [r for r in store.effects_read("c") if r.key in (old.key, "k-new")]
    assert again == old
    assert (last.key, last.published_at is not None) == ("k-new", True)


def test_schema_4_effects_become_a_log_with_published_runs(
    fresh_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_schema_4_store(fresh_url, monkeypatch)
    before = read_schema_4(fresh_url, monkeypatch)
    assert sum(r.published_at is not None for r in before["effects"]) == 1000 + 2
    with open_store(fresh_url) as store:
        check_schema_5(store, before)


def stored_version(url: str) -> tuple[int, set[str]]:
    """The schema version and the store's tables, read with the driver alone."""
    if url.startswith("sqlite:"):
        with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as conn:
            version = conn.execute("SELECT max(version) FROM meshforge_schema_version").fetchone()
            names = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    else:
        database, _, schema = url.partition("?schema=")
        with psycopg.connect(database) as conn:
            version = conn.execute(
                f'SELECT max(version) FROM "{schema}".meshforge_schema_version'
            ).fetchone()
            names = conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,)
            ).fetchall()
    assert version is not None
    return int(version[0]), {n[0] for n in names if n[0].startswith("meshforge_")}


# A process that runs the migration to schema 5 and kills itself (SIGKILL) part way: before
# step N of it (argv[2], a number), or once the version is noted but not yet committed.
_KILLED_MIGRATION = """
import os, signal, sys
from meshforge.store import open_store, schema
from meshforge.store.sql import Runner

url, at = sys.argv[1], sys.argv[2]

def die(*_):
    os.kill(os.getpid(), signal.SIGKILL)

if at == "noted":
    rows = Runner.rows
    def rows_then_die(self, sql, params=(), **kw):
        out = rows(self, sql, params, **kw)
        if sql.startswith("INSERT INTO meshforge_schema_version"):
            die()
        return out
    Runner.rows = rows_then_die
else:
    version, steps = schema.MIGRATIONS[-1]
    schema.MIGRATIONS[-1] = (version, [*steps[: int(at)], die, *steps[int(at) :]])
open_store(url).close()
sys.exit(3)  # never: the process was to die
"""


def test_a_killed_migration_leaves_schema_4_and_runs_again(
    fresh_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import meshforge
    from meshforge.store.sequencing import STEPS

    make_schema_4_store(fresh_url, monkeypatch)
    before = read_schema_4(fresh_url, monkeypatch)
    _, tables = stored_version(fresh_url)
    env = {**os.environ, "PYTHONPATH": str(Path(meshforge.__file__).parents[1])}
    # Before anything, after the copy, after the runs, after the old table's drop and its
    # successor's rename, before the events and states (SQLite), after every step, and
    # with the version noted.
    for at in ("0", "2", "4", "6", "8", str(len(STEPS)), "noted"):
        child = subprocess.run(
            [sys.executable, "-c", _KILLED_MIGRATION, fresh_url, at],
            env=env, capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        assert child.returncode == -signal.SIGKILL, (at, child.stderr.decode()[-2000:])
        assert stored_version(fresh_url) == (4, tables), at
    assert read_schema_4(fresh_url, monkeypatch) == before
    with open_store(fresh_url) as store:
        check_schema_5(store, before)


def test_schema_4_migrates_with_every_digest_alike_on_sqlite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys, event ids and resources that share one digest stay apart through the copy."""
    from meshforge.store import sequencing

    url = f"sqlite:///{tmp_path / 'old.db'}"
    make_schema_4_store(url, monkeypatch)
    before = read_schema_4(url, monkeypatch)
    monkeypatch.setattr(sequencing, "digests", lambda t, ns, owner, names: [7] * len(names))
    with open_store(url) as store:
        with store.transaction() as tx:
            for table, column in (("effects", "kd"), ("events", "ed"), ("states", "sd")):
                assert tx.execute(f"SELECT DISTINCT {column} FROM meshforge_{table}") == [(7,)]
        check_schema_5(store, before)
