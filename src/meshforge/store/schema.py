"""The store's tables, as numbered migrations applied once each on open.

DDL is written once with ``{ts}``, ``{blob}`` and ``{id}`` standing for the dialect's
types, so SQLite and PostgreSQL share one schema. Tables carry a ``meshforge_`` prefix
so they sit beside the user's own tables in the same database.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from meshforge.errors import StoreError
from meshforge.store.packing import STEPS as PACK_STEPS
from meshforge.store.scoping import STEPS as SCOPE_STEPS
from meshforge.store.scoping import Step
from meshforge.store.sequencing import STEPS as SEQUENCE_STEPS

if TYPE_CHECKING:
    from meshforge.store.sql import Dialect, Runner

VERSION_TABLE = (
    "CREATE TABLE IF NOT EXISTS meshforge_schema_version ("
    " version INTEGER PRIMARY KEY, applied_at {ts} NOT NULL)"
)

# Append new versions; never edit a released one. A step is DDL or a data move in Python.
MIGRATIONS: list[tuple[int, list[Step]]] = [
    (
        1,
        [
            """CREATE TABLE meshforge_inbox (
                key TEXT NOT NULL, consumer TEXT NOT NULL, message_id TEXT, type TEXT,
                subject TEXT, stream TEXT, stream_seq BIGINT, status TEXT NOT NULL,
                attempts INTEGER NOT NULL DEFAULT 0, deliveries INTEGER NOT NULL DEFAULT 0,
                error TEXT, resource_type TEXT, resource_id TEXT,
                headers TEXT NOT NULL DEFAULT '{{}}', received_at {ts} NOT NULL,
                processed_at {ts}, failed_at {ts}, created_at {ts} NOT NULL,
                updated_at {ts} NOT NULL, PRIMARY KEY (key, consumer))""",
            "CREATE INDEX meshforge_inbox_consumer ON meshforge_inbox (consumer, key)",
            "CREATE INDEX meshforge_inbox_status ON meshforge_inbox (status, updated_at)",
            """CREATE TABLE meshforge_effects (
                consumer TEXT NOT NULL, key TEXT NOT NULL, command_id TEXT NOT NULL,
                created_at {ts} NOT NULL, published_at {ts}, PRIMARY KEY (consumer, key))""",
            "CREATE INDEX meshforge_effects_created ON meshforge_effects (created_at)",
            """CREATE TABLE meshforge_effect_outputs (
                consumer TEXT NOT NULL, key TEXT NOT NULL, position INTEGER NOT NULL,
                subject TEXT NOT NULL, msg_id TEXT NOT NULL, data {blob} NOT NULL,
                headers TEXT NOT NULL, PRIMARY KEY (consumer, key, position))""",
            """CREATE TABLE meshforge_agent_heads (
                agent TEXT PRIMARY KEY, position BIGINT NOT NULL)""",
            """CREATE TABLE meshforge_events (
                agent TEXT NOT NULL, position BIGINT NOT NULL, event_id TEXT NOT NULL,
                type TEXT NOT NULL, resource_id TEXT, command_id TEXT NOT NULL,
                key TEXT NOT NULL, data {blob} NOT NULL, ts TEXT NOT NULL,
                stored_at {ts} NOT NULL, PRIMARY KEY (agent, position),
                UNIQUE (agent, event_id))""",
            """CREATE TABLE meshforge_states (
                agent TEXT NOT NULL, resource_id TEXT NOT NULL, data {blob} NOT NULL,
                position BIGINT NOT NULL, updated_at {ts} NOT NULL,
                PRIMARY KEY (agent, resource_id))""",
            """CREATE TABLE meshforge_outbox (
                id {id}, msg_id TEXT NOT NULL, subject TEXT NOT NULL, data {blob} NOT NULL,
                headers TEXT NOT NULL, state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
                error TEXT, lease_owner TEXT, lease_until {ts}, retry_at {ts},
                given_up_at {ts}, created_at {ts} NOT NULL, updated_at {ts} NOT NULL,
                sent_at {ts})""",
            "CREATE INDEX meshforge_outbox_state ON meshforge_outbox (state, id)",
            "CREATE INDEX meshforge_outbox_msg_id ON meshforge_outbox (msg_id)",
            """CREATE TABLE meshforge_node_epochs (
                site TEXT NOT NULL, node TEXT NOT NULL, epoch BIGINT NOT NULL,
                updated_at {ts} NOT NULL, PRIMARY KEY (site, node))""",
            """CREATE TABLE meshforge_node_replies (
                site TEXT NOT NULL, node TEXT NOT NULL, command_id TEXT NOT NULL,
                reply {blob} NOT NULL, created_at {ts} NOT NULL,
                PRIMARY KEY (site, node, command_id))""",
        ],
    ),
    # Tenant and namespace in the keys of states, events, effects and inbox rows.
    (2, SCOPE_STEPS),
    # An effect's outputs packed into its own row (one key written per effect, not two).
    (3, PACK_STEPS),
    # Held deliveries per command (meshforge.runtime.holds): they are not attempts.
    (
        4,
        [
            """CREATE TABLE meshforge_holds (
                tenant TEXT NOT NULL, namespace TEXT NOT NULL, consumer TEXT NOT NULL,
                key TEXT NOT NULL, resource_id TEXT NOT NULL, seq BIGINT NOT NULL,
                held INTEGER NOT NULL, stopped INTEGER NOT NULL DEFAULT 0,
                since DOUBLE PRECISION NOT NULL,
                updated_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (tenant, namespace, consumer, key))""",
        ],
    ),
    # Effects and publishing progress as logs; SQLite's random keys in digest indexes.
    (5, SEQUENCE_STEPS),
]

LATEST = MIGRATIONS[-1][0]


def migrate(run: Runner, dialect: Dialect, now: datetime) -> int:
    """Bring the schema to ``LATEST`` inside the caller's transaction; returns the version.

    The dialect's migration lock makes concurrent opens apply each step once.
    """
    if dialect.migration_lock:
        run.rows(dialect.migration_lock)
    run.rows(dialect.ddl(VERSION_TABLE))
    row = run.rows("SELECT max(version) FROM meshforge_schema_version")
    current = int(row[0][0] or 0)
    if current > LATEST:
        raise StoreError(
            f"store schema version {current} is newer than this MeshForge supports ({LATEST}); "
            "upgrade MeshForge"
        )
    for version, statements in MIGRATIONS:
        if version <= current:
            continue
        for statement in statements:
            if callable(statement):
                statement(run, dialect)
            else:
                run.rows(dialect.ddl(statement))
        run.rows(
            "INSERT INTO meshforge_schema_version (version, applied_at) VALUES (?, ?)",
            (version, dialect.ts_in(now)),
        )
        current = version
    return current
