"""``SqlTransaction``: the store's writes inside one database transaction, for both dialects."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, NoReturn, cast

from meshforge.errors import StoreError
from meshforge.store import sequencing
from meshforge.store.base import (
    InboxRecord,
    InboxStatus,
    NewEffect,
    NewEvent,
    NewState,
    OutboxMessage,
    StoredOutput,
)
from meshforge.store.batch import BatchMethods
from meshforge.store.packing import unpack_outputs
from meshforge.store.sql import (
    Dialect,
    Runner,
    clean_text,
    dump_headers,
    load_headers,
    spoils,
    ts_or_none,
)
from meshforge.topology.scope import DEFAULT_SCOPE, Scope

INBOX_COLUMNS = (
    "key, consumer, message_id, type, subject, stream, stream_seq, status, attempts, "
    "deliveries, error, resource_type, resource_id, headers, received_at, processed_at, "
    "failed_at, created_at, updated_at, tenant, namespace"
)

# SQLite: the digest index, not the log's own (tenant, namespace, agent, position), which
# the planner could take for its three equalities and read the whole log through.
_EVENT_IDS_ONE_SCOPE = (
    "SELECT event_id FROM meshforge_events INDEXED BY meshforge_events_ed"
    " WHERE tenant = ? AND namespace = ? AND agent = ? AND ed IN (VALUES {rows})"
)

_INBOX_BEGIN = f"""
INSERT INTO meshforge_inbox (tenant, namespace, key, consumer, message_id, type, subject,
    stream, stream_seq, status, attempts, deliveries, resource_type, resource_id, headers,
    received_at, created_at, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'processing', 1, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (tenant, namespace, key, consumer) DO UPDATE SET
    attempts = CASE WHEN meshforge_inbox.status = 'processed' THEN meshforge_inbox.attempts
                    ELSE meshforge_inbox.attempts + 1 END,
    deliveries = CASE WHEN meshforge_inbox.status = 'processed' THEN meshforge_inbox.deliveries
                      ELSE excluded.deliveries END,
    updated_at = CASE WHEN meshforge_inbox.status = 'processed' THEN meshforge_inbox.updated_at
                      ELSE excluded.updated_at END,
    status = CASE WHEN meshforge_inbox.status = 'processed' THEN 'processed'
                  ELSE 'processing' END
RETURNING {INBOX_COLUMNS}
"""


def inbox_record(dialect: Dialect, row: Sequence[Any]) -> InboxRecord:
    """An ``INBOX_COLUMNS`` row as a record."""
    return InboxRecord(
        key=row[0],
        consumer=row[1],
        message_id=row[2],
        type=row[3],
        subject=row[4],
        stream=row[5],
        stream_seq=None if row[6] is None else int(row[6]),
        status=cast(InboxStatus, row[7]),
        attempts=int(row[8]),
        deliveries=int(row[9]),
        error=row[10],
        resource_type=row[11],
        resource_id=row[12],
        headers=load_headers(row[13]),
        received_at=dialect.ts_out(row[14]),
        processed_at=ts_or_none(dialect, row[15]),
        failed_at=ts_or_none(dialect, row[16]),
        created_at=dialect.ts_out(row[17]),
        updated_at=dialect.ts_out(row[18]),
        scope=Scope(row[19], row[20]),
    )


class SqlTransaction(BatchMethods):
    """The ``Transaction`` protocol over one ``Runner``; see ``meshforge.store.base``."""

    def __init__(self, run: Runner, now: datetime) -> None:
        self._run = run
        self._d = run.dialect
        # One timestamp per transaction: every row it writes agrees on when.
        self._now = self._d.ts_in(now)
        # sqlite3 binds a bytearray as is, where it first asks its adapters about bytes (a
        # few thousand instructions a value, more than the copy): blobs of the batch writes
        # go to SQLite as bytearrays. They are stored and read back the same.
        self._blob: Callable[[Any], Any] = bytearray if self._d.embedded else bytes
        self._absent = set()
        self._state_rows = {}

    @property
    def failed(self) -> bool:
        return self._run.failed

    @spoils
    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        if "meshforge_effects" in sql or "meshforge_states" in sql:
            # SQL of the caller's own may change what this transaction remembers it read.
            self._absent.clear()
            self._state_rows.clear()
        return self._run.rows(sql, params)

    @spoils
    def inbox_begin(
        self,
        key: str,
        consumer: str,
        *,
        message_id: str | None,
        type: str | None,
        subject: str | None,
        stream: str | None,
        stream_seq: int | None,
        deliveries: int,
        headers: dict[str, str],
        resource_type: str | None = None,
        resource_id: str | None = None,
        scope: Scope = DEFAULT_SCOPE,
    ) -> InboxRecord:
        now = self._now
        params = (
            scope.tenant, scope.namespace, key, consumer, message_id, type, subject, stream, stream_seq, deliveries,
            resource_type, resource_id, dump_headers(headers), now, now, now,
        )  # fmt: skip
        rows = self._run.rows(_INBOX_BEGIN, params)
        return inbox_record(self._d, rows[0])

    @spoils
    def inbox_done(self, key: str, consumer: str, *, scope: Scope = DEFAULT_SCOPE) -> None:
        changed = self._run.count(
            "UPDATE meshforge_inbox SET status = 'processed', processed_at = ?, error = NULL,"
            " updated_at = ? WHERE tenant = ? AND namespace = ? AND key = ? AND consumer = ?",
            (self._now, self._now, scope.tenant, scope.namespace, key, consumer),
        )
        self._require(changed, "inbox", consumer, key)

    @spoils
    def inbox_failed(
        self, key: str, consumer: str, error: str, *, scope: Scope = DEFAULT_SCOPE
    ) -> None:
        changed = self._run.count(
            "UPDATE meshforge_inbox SET status = 'failed', failed_at = ?, error = ?,"
            " updated_at = ? WHERE tenant = ? AND namespace = ? AND key = ? AND consumer = ?",
            (self._now, clean_text(error), self._now, scope.tenant, scope.namespace, key,
             consumer),
        )  # fmt: skip
        self._require(changed, "inbox", consumer, key)

    @spoils
    def effect_get(
        self, consumer: str, key: str, *, scope: Scope = DEFAULT_SCOPE
    ) -> list[StoredOutput] | None:
        if self._d.embedded:
            return self.effects_get(consumer, [(scope, key)])[(scope, key)]
        rows = self._run.rows(
            "SELECT outputs FROM meshforge_effects"
            " WHERE tenant = ? AND namespace = ? AND consumer = ? AND key = ?",
            (scope.tenant, scope.namespace, consumer, key),
        )
        return unpack_outputs(rows[0][0]) if rows else None

    @spoils
    def effect_put(
        self,
        consumer: str,
        key: str,
        command_id: str,
        outputs: Sequence[StoredOutput],
        *,
        scope: Scope = DEFAULT_SCOPE,
    ) -> None:
        self.effects_put(consumer, [NewEffect(key, command_id, outputs, scope)])

    @spoils
    def effect_mark_published(
        self, consumer: str, key: str, *, scope: Scope = DEFAULT_SCOPE
    ) -> None:
        changed = self.effects_mark_published(consumer, [(scope, key)])
        self._require(changed, "effect", consumer, key)

    @spoils
    def events_append(
        self, agent: str, events: Sequence[NewEvent], *, scope: Scope = DEFAULT_SCOPE
    ) -> list[int]:
        if not events:
            return []
        t, ns = scope.tenant, scope.namespace
        found: list[int] = []
        if self._d.embedded:
            ids = [e.event_id for e in events]
            found = sequencing.digests(t, ns, agent, ids)
            self._refuse_known_events(agent, scope, ids, found)
        # The head row is locked until commit, so concurrent appends take turns: gapless.
        head = self._run.rows(
            "INSERT INTO meshforge_agent_heads (tenant, namespace, agent, position)"
            " VALUES (?, ?, ?, ?) ON CONFLICT (tenant, namespace, agent) DO UPDATE"
            " SET position = meshforge_agent_heads.position + excluded.position"
            " RETURNING position",
            (t, ns, agent, len(events)),
        )
        first = int(head[0][0]) - len(events) + 1
        positions = list(range(first, first + len(events)))
        blob = self._blob
        if self._d.embedded:
            # What every row shares is bound once a statement, not once a row; the event
            # id's digest goes into the narrow index that finds it again.
            self._run.each(
                "INSERT INTO meshforge_events (tenant, namespace, agent, position, ed, event_id,"
                " type, resource_id, command_id, key, data, ts, stored_at) SELECT ?, ?, ?,"
                " column1, column2, column3, column4, column5, column6, column7, column8,"
                " column9, ? FROM (VALUES {rows})",
                [(pos, d, e.event_id, e.type, e.resource_id, e.command_id, e.key, blob(e.data),
                  e.ts) for pos, d, e in zip(positions, found, events, strict=True)],
                (t, ns, agent, self._now),
            )  # fmt: skip
            return positions
        target = (
            "meshforge_events (tenant, namespace, agent, position, event_id, type, resource_id,"
            " command_id, key, data, ts, stored_at)"
        )
        self._run.insert(
            target,
            [
                (t, ns, agent, pos, e.event_id, e.type, e.resource_id, e.command_id, e.key,
                 blob(e.data), e.ts, self._now)
                for pos, e in zip(positions, events, strict=True)
            ],
        )  # fmt: skip
        return positions

    def _refuse_known_events(
        self, agent: str, scope: Scope, ids: Sequence[str], found: Sequence[int]
    ) -> None:
        """SQLite: a ``duplicate`` error for an event id given twice or already in the log
        of (scope, agent), found by its digest (one writer at a time: none can come
        between this look and the append)."""
        seen: set[str] = set()
        for event_id in ids:
            if event_id in seen:
                self._duplicate_event(agent, scope, event_id, "is given twice")
            seen.add(event_id)
        for (event_id,) in self._by_digest(_EVENT_IDS_ONE_SCOPE, scope, agent, ids, found)[:1]:
            self._duplicate_event(agent, scope, event_id, "is already in the log")

    @staticmethod
    def _duplicate_event(agent: str, scope: Scope, event_id: str, what: str) -> NoReturn:
        raise StoreError(
            f"event log of agent {agent!r} in {scope}: event id {event_id!r} {what}",
            kind="duplicate",
        )

    @spoils
    def state_get(
        self, agent: str, resource_id: str, *, scope: Scope = DEFAULT_SCOPE
    ) -> bytes | None:
        t, ns = scope.tenant, scope.namespace
        if self._d.embedded:
            return self.states_get(agent, [(scope, resource_id)])[(scope, resource_id)]
        if self._d.resource_lock:
            # Serialises workers on one resource even before its first snapshot exists.
            self._run.rows(self._d.resource_lock, (f"{t}\x1f{ns}\x1f{agent}\x1f{resource_id}",))
        rows = self._run.rows(
            "SELECT data FROM meshforge_states WHERE tenant = ? AND namespace = ?"
            " AND agent = ? AND resource_id = ?" + self._d.for_update,
            (t, ns, agent, resource_id),
        )
        return bytes(rows[0][0]) if rows else None

    @spoils
    def state_put(
        self,
        agent: str,
        resource_id: str,
        data: bytes,
        position: int,
        *,
        scope: Scope = DEFAULT_SCOPE,
    ) -> None:
        if self._d.embedded:
            self.states_put(agent, [NewState(resource_id, data, position, scope)])
            return
        self._run.rows(
            "INSERT INTO meshforge_states (tenant, namespace, agent, resource_id, data, position,"
            " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (tenant, namespace, agent, resource_id) DO UPDATE"
            " SET data = excluded.data, position = excluded.position,"
            " updated_at = excluded.updated_at",
            (scope.tenant, scope.namespace, agent, resource_id, bytes(data), position, self._now),
        )

    @spoils
    def outbox_add(self, *, msg_id: str, subject: str, data: bytes, headers: dict[str, str]) -> int:
        rows = self._run.rows(
            "INSERT INTO meshforge_outbox (msg_id, subject, data, headers, state, attempts,"
            " created_at, updated_at) VALUES (?, ?, ?, ?, 'pending', 0, ?, ?) RETURNING id",
            (msg_id, subject, bytes(data), dump_headers(headers), self._now, self._now),
        )
        return int(rows[0][0])

    @spoils
    def outbox_add_many(self, messages: Sequence[OutboxMessage]) -> list[int]:
        now = self._now
        rows = [(m.msg_id, m.subject, bytes(m.data), dump_headers(m.headers), "pending", 0,
                 now, now) for m in messages]  # fmt: skip
        sql = (
            "INSERT INTO meshforge_outbox (msg_id, subject, data, headers, state, attempts,"
            " created_at, updated_at) VALUES {rows}"
        )
        if self._run.dialect.name == "sqlite":
            # No RETURNING: sqlite3 steps, letting go of the GIL, once per returned row.
            # Under the write lock each AUTOINCREMENT id is the one before plus one.
            added = self._run.each_count(sql, rows)
            last = int(self._run.rows("SELECT last_insert_rowid()")[0][0])
            return list(range(last - added + 1, last + 1))
        ids = self._run.each(sql + " RETURNING id", rows)
        # Ids rise in the order of the VALUES list; RETURNING's own order is not promised.
        return sorted(int(row[0]) for row in ids)

    @spoils
    def node_epoch_bump(self, site: str, node: str) -> int:
        rows = self._run.rows(
            "INSERT INTO meshforge_node_epochs (site, node, epoch, updated_at)"
            " VALUES (?, ?, 1, ?) ON CONFLICT (site, node) DO UPDATE"
            " SET epoch = meshforge_node_epochs.epoch + 1, updated_at = excluded.updated_at"
            " RETURNING epoch",
            (site, node, self._now),
        )
        return int(rows[0][0])

    @spoils
    def node_epoch(self, site: str, node: str) -> int | None:
        rows = self._run.rows(
            "SELECT epoch FROM meshforge_node_epochs WHERE site = ? AND node = ?", (site, node)
        )
        return int(rows[0][0]) if rows else None

    @spoils
    def node_reply_get(self, site: str, node: str, command_id: str) -> bytes | None:
        rows = self._run.rows(
            "SELECT reply FROM meshforge_node_replies"
            " WHERE site = ? AND node = ? AND command_id = ?",
            (site, node, command_id),
        )
        return bytes(rows[0][0]) if rows else None

    @spoils
    def node_reply_put(self, site: str, node: str, command_id: str, reply: bytes) -> None:
        try:
            self._run.rows(
                "INSERT INTO meshforge_node_replies (site, node, command_id, reply, created_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (site, node, command_id, bytes(reply), self._now),
            )
        except StoreError as exc:
            if exc.kind != "duplicate":
                raise
            raise StoreError(
                f"reply of node {site}.{node} to command {command_id!r} is already stored",
                kind="duplicate",
            ) from exc

    @staticmethod
    def _require(changed: int, what: str, consumer: str, key: str) -> None:
        if changed == 0:
            raise StoreError(
                f"no {what} row for consumer {consumer!r} key {key!r}", kind="not_found"
            )
