"""Schema version 2: tenant and namespace join the keys of everything an agent keeps.

Existing rows move to the scope their subject names (``cmd.<tenant>.<ns>.…`` or
``evt.<tenant>.<ns>.…``): inbox rows by their own subject (else their ``Tenant-Id``
header, namespace ``default``); effects by the subject of their first stored output;
events by the subject of the output that published them (matched on the event id);
states follow the event at their position. Anything no subject names stays in
``default``/``default``. Events are renumbered gaplessly per (tenant, namespace, agent)
in their old order, so replay and the state hash of each log are what they were.

SQLite cannot change a primary key in place, so each table is rebuilt (``_v2``, copy,
drop, rename) on both backends alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from meshforge.topology.scope import DEFAULT_SCOPE, Scope

if TYPE_CHECKING:
    from meshforge.store.sql import Dialect, Runner

Step = str | Callable[["Runner", "Dialect"], None]

_PAGE = 1000
_CHUNK = 100  # rows per multi-row statement, far below every driver's parameter limit

_SCOPE_COLS = "tenant TEXT NOT NULL DEFAULT 'default', namespace TEXT NOT NULL DEFAULT 'default'"

_INBOX_COLS = (
    "key, consumer, message_id, type, subject, stream, stream_seq, status, attempts,"
    " deliveries, error, resource_type, resource_id, headers, received_at, processed_at,"
    " failed_at, created_at, updated_at"
)
_EVENT_COLS = "event_id, type, resource_id, command_id, key, data, ts, stored_at"


def _pages(run: Runner, sql: str, width: int) -> Iterator[list[tuple[Any, ...]]]:
    """Pages of ``sql`` (which has ``{after}`` for a keyset on its first ``width`` columns)."""
    after: tuple[Any, ...] | None = None
    cols = ", ".join(f"k{i}" for i in range(width))
    while True:
        where = "" if after is None else f"WHERE ({cols}) > ({', '.join('?' * width)})"
        rows = run.rows(sql.format(after=where) + f" LIMIT {_PAGE}", after or ())
        if rows:
            yield rows
        if len(rows) < _PAGE:
            return
        after = tuple(rows[-1][:width])


def _rescope(
    run: Runner, table: str, keys: Sequence[str], moves: dict[Scope, list[tuple[Any, ...]]]
) -> None:
    """Move rows (named by ``keys`` values, all still in the default scope) to their scope."""
    group = "(" + ", ".join("?" * len(keys)) + ")"
    for scope, rows in moves.items():
        if scope == DEFAULT_SCOPE:
            continue
        for start in range(0, len(rows), _CHUNK):
            chunk = rows[start : start + _CHUNK]
            run.rows(
                f"UPDATE {table} SET tenant = ?, namespace = ? WHERE ({', '.join(keys)}) IN"
                f" (VALUES {', '.join([group] * len(chunk))})",
                (scope.tenant, scope.namespace, *[v for row in chunk for v in row]),
            )


def _insert_many(run: Runner, target: str, rows: Sequence[tuple[Any, ...]]) -> None:
    if not rows:
        return
    group = "(" + ", ".join("?" * len(rows[0])) + ")"
    for start in range(0, len(rows), _CHUNK):
        chunk = rows[start : start + _CHUNK]
        run.rows(
            f"INSERT INTO {target} VALUES {', '.join([group] * len(chunk))}",
            [v for row in chunk for v in row],
        )


def _copy_events(run: Runner, dialect: Dialect) -> None:
    """Old per-agent log to per-(scope, agent) logs, renumbered in the old order."""
    heads: dict[tuple[Scope, str], int] = {}
    sql = (
        "SELECT k0, k1, event_id, type, resource_id, command_id, key, data, ts, stored_at,"
        " subject FROM (SELECT e.agent AS k0, e.position AS k1, e.event_id, e.type,"
        " e.resource_id, e.command_id, e.key, e.data, e.ts, e.stored_at,"
        " (SELECT min(o.subject) FROM meshforge_effect_outputs o WHERE o.msg_id = e.event_id)"
        " AS subject FROM meshforge_events e) q {after} ORDER BY k0, k1"
    )
    for rows in _pages(run, sql, 2):
        out = []
        for r in rows:
            scope = Scope.of_subject(r[10]) or DEFAULT_SCOPE
            position = heads[(scope, r[0])] = heads.get((scope, r[0]), 0) + 1
            out.append((scope.tenant, scope.namespace, r[0], position, *r[2:10]))
        _insert_many(
            run, f"meshforge_events_v2 (tenant, namespace, agent, position, {_EVENT_COLS})", out
        )


def _scope_effects(run: Runner, dialect: Dialect) -> None:
    """Each effect to the scope its first output's subject names."""
    moves: dict[Scope, list[tuple[Any, ...]]] = {}
    sql = (
        "SELECT k0, k1, subject FROM (SELECT o.consumer AS k0, o.key AS k1, o.subject"
        " FROM meshforge_effect_outputs o WHERE o.position = (SELECT min(p.position)"
        " FROM meshforge_effect_outputs p WHERE p.consumer = o.consumer AND p.key = o.key)) q"
        " {after} ORDER BY k0, k1"
    )
    for rows in _pages(run, sql, 2):
        for consumer, key, subject in rows:
            scope = Scope.of_subject(subject) or DEFAULT_SCOPE
            moves.setdefault(scope, []).append((consumer, key))
    _rescope(run, "meshforge_effects_v2", ("consumer", "key"), moves)


def _scope_inbox(run: Runner, dialect: Dialect) -> None:
    """Each inbox row to its subject's scope, else its Tenant-Id header's tenant."""
    moves: dict[Scope, list[tuple[Any, ...]]] = {}
    sql = (
        "SELECT k0, k1, subject, headers FROM (SELECT key AS k0, consumer AS k1, subject,"
        " headers FROM meshforge_inbox_v2) q {after} ORDER BY k0, k1"
    )
    for rows in _pages(run, sql, 2):
        for key, consumer, subject, headers in rows:
            scope = Scope.of_subject(subject)
            if scope is None:
                try:
                    tenant = json.loads(headers or "{}").get("Tenant-Id")
                except (ValueError, AttributeError):
                    tenant = None
                scope = Scope(tenant) if isinstance(tenant, str) and tenant else DEFAULT_SCOPE
            moves.setdefault(scope, []).append((key, consumer))
    _rescope(run, "meshforge_inbox_v2", ("key", "consumer"), moves)


STEPS: list[Step] = [
    # Lookups the data moves need, dropped with the old tables.
    "CREATE INDEX meshforge_migrate_outputs_msg ON meshforge_effect_outputs (msg_id)",
    f"""CREATE TABLE meshforge_events_v2 (
        {_SCOPE_COLS}, agent TEXT NOT NULL, position BIGINT NOT NULL, event_id TEXT NOT NULL,
        type TEXT NOT NULL, resource_id TEXT, command_id TEXT NOT NULL,
        key TEXT NOT NULL, data {{blob}} NOT NULL, ts TEXT NOT NULL,
        stored_at {{ts}} NOT NULL, PRIMARY KEY (tenant, namespace, agent, position),
        UNIQUE (tenant, namespace, agent, event_id))""",
    _copy_events,
    "CREATE INDEX meshforge_migrate_events ON meshforge_events_v2 (agent, event_id)",
    f"""CREATE TABLE meshforge_agent_heads_v2 (
        {_SCOPE_COLS}, agent TEXT NOT NULL, position BIGINT NOT NULL,
        PRIMARY KEY (tenant, namespace, agent))""",
    """INSERT INTO meshforge_agent_heads_v2 (tenant, namespace, agent, position)
        SELECT tenant, namespace, agent, max(position) FROM meshforge_events_v2
        GROUP BY tenant, namespace, agent""",
    f"""CREATE TABLE meshforge_states_v2 (
        {_SCOPE_COLS}, agent TEXT NOT NULL, resource_id TEXT NOT NULL, data {{blob}} NOT NULL,
        position BIGINT NOT NULL, updated_at {{ts}} NOT NULL,
        PRIMARY KEY (tenant, namespace, agent, resource_id))""",
    """INSERT INTO meshforge_states_v2 (tenant, namespace, agent, resource_id, data, position,
        updated_at)
        SELECT COALESCE(n.tenant, 'default'), COALESCE(n.namespace, 'default'), s.agent,
        s.resource_id, s.data, COALESCE(n.position, s.position), s.updated_at
        FROM meshforge_states s
        LEFT JOIN meshforge_events e ON e.agent = s.agent AND e.position = s.position
        LEFT JOIN meshforge_events_v2 n ON n.agent = e.agent AND n.event_id = e.event_id""",
    f"""CREATE TABLE meshforge_effects_v2 (
        {_SCOPE_COLS}, consumer TEXT NOT NULL, key TEXT NOT NULL, command_id TEXT NOT NULL,
        created_at {{ts}} NOT NULL, published_at {{ts}},
        PRIMARY KEY (tenant, namespace, consumer, key))""",
    """INSERT INTO meshforge_effects_v2 (consumer, key, command_id, created_at, published_at)
        SELECT consumer, key, command_id, created_at, published_at FROM meshforge_effects""",
    _scope_effects,
    f"""CREATE TABLE meshforge_effect_outputs_v2 (
        {_SCOPE_COLS}, consumer TEXT NOT NULL, key TEXT NOT NULL, position INTEGER NOT NULL,
        subject TEXT NOT NULL, msg_id TEXT NOT NULL, data {{blob}} NOT NULL,
        headers TEXT NOT NULL, PRIMARY KEY (tenant, namespace, consumer, key, position))""",
    """INSERT INTO meshforge_effect_outputs_v2 (tenant, namespace, consumer, key, position,
        subject, msg_id, data, headers)
        SELECT e.tenant, e.namespace, o.consumer, o.key, o.position, o.subject, o.msg_id,
        o.data, o.headers FROM meshforge_effect_outputs o JOIN meshforge_effects_v2 e
        ON e.consumer = o.consumer AND e.key = o.key""",
    f"""CREATE TABLE meshforge_inbox_v2 (
        {_SCOPE_COLS}, key TEXT NOT NULL, consumer TEXT NOT NULL, message_id TEXT, type TEXT,
        subject TEXT, stream TEXT, stream_seq BIGINT, status TEXT NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0, deliveries INTEGER NOT NULL DEFAULT 0,
        error TEXT, resource_type TEXT, resource_id TEXT,
        headers TEXT NOT NULL DEFAULT '{{{{}}}}', received_at {{ts}} NOT NULL,
        processed_at {{ts}}, failed_at {{ts}}, created_at {{ts}} NOT NULL,
        updated_at {{ts}} NOT NULL, PRIMARY KEY (tenant, namespace, key, consumer))""",
    f"INSERT INTO meshforge_inbox_v2 ({_INBOX_COLS}) SELECT {_INBOX_COLS} FROM meshforge_inbox",
    _scope_inbox,
    "DROP INDEX meshforge_migrate_events",
    *[
        statement
        for table in ("events", "agent_heads", "states", "effects", "effect_outputs", "inbox")
        for statement in (
            f"DROP TABLE meshforge_{table}",
            f"ALTER TABLE meshforge_{table}_v2 RENAME TO meshforge_{table}",
        )
    ],
    "CREATE INDEX meshforge_effects_created ON meshforge_effects (created_at)",
    "CREATE INDEX meshforge_inbox_consumer ON meshforge_inbox (consumer, key)",
    "CREATE INDEX meshforge_inbox_status ON meshforge_inbox (status, updated_at)",
]
