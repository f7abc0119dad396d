"""``SqlStore``: the store-level operations shared by both backends.

A backend supplies ``_session`` (a cursor inside one open transaction that commits on a
clean exit and rolls back on an exception) and ``_release``; everything else is here.
Reads page by key (keyset pagination), so no lock or connection is held while the caller
consumes an iterator and memory stays bounded however large the tables grow.
"""

from __future__ import annotations

import operator
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar, cast

from meshforge.errors import StoreError
from meshforge.store.base import (
    DialectName,
    EffectRecord,
    InboxRecord,
    InboxStatus,
    NodeInfo,
    OutboxRow,
    OutboxState,
    StoredEvent,
    Transaction,
)
from meshforge.store.packing import unpack_outputs
from meshforge.store.sequencing import PUBLISHED_AT
from meshforge.store.sql import (
    Cursor,
    Dialect,
    Runner,
    clean_text,
    in_clause,
    load_headers,
)
from meshforge.store.transaction import INBOX_COLUMNS, SqlTransaction, inbox_record
from meshforge.topology.scope import DEFAULT_SCOPE, Scope

T = TypeVar("T")
Clock = Callable[[], datetime]
# What a commit survives before its commands are acknowledged (docs/STORE.md "Durability"):
# "sync" a power cut (each commit synced), "os" a killed process (the OS has the writes).
Durability = Literal["sync", "os"]
DURABILITIES: tuple[Durability, ...] = ("sync", "os")

_OUTBOX_COLUMNS = "id, msg_id, subject, data, headers, attempts, state, created_at"
_EVENT_COLUMNS = (
    "event_id, type, resource_id, command_id, key, data, ts, agent, position, stored_at,"
    " tenant, namespace"
)


_first = operator.itemgetter(0)
# Runs that end before the oldest effect kept (every run, when none is); ``first_seq``
# bounds the index range read, as a run never starts after it ends.
_OLDEST_KEPT = "(SELECT COALESCE(min(seq), 9223372036854775807) FROM meshforge_effects)"
_RUNS_CLEANUP = (
    f"DELETE FROM meshforge_published WHERE first_seq < {_OLDEST_KEPT}"
    f" AND last_seq < {_OLDEST_KEPT}"
)


def system_clock() -> datetime:
    return datetime.now(UTC)


class SqlStore(ABC):
    """The ``Store`` protocol over a dialect and a backend session; see ``base.Store``."""

    #: Rows fetched per page by the streaming readers.
    page_size = 500

    def __init__(self, url: str, dialect: Dialect, clock: Clock | None = None) -> None:
        self._url = url
        self._dialect = dialect
        self._clock = clock or system_clock

    @property
    def url(self) -> str:
        return self._url

    @property
    def dialect(self) -> DialectName:
        return self._dialect.name

    @abstractmethod
    def _session(self, *, write: bool) -> AbstractContextManager[Cursor]:
        """A cursor inside one transaction; commit on clean exit, roll back on error."""

    @abstractmethod
    def _release(self) -> None:
        """Close connections; later sessions raise ``StoreError(kind="closed")``."""

    def close(self) -> None:
        self._release()

    def __enter__(self) -> SqlStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._dialect.name}>"

    def transaction(self) -> AbstractContextManager[Transaction]:
        return self._transaction(self._session(write=True))

    def transaction_now(self) -> tuple[AbstractContextManager[Transaction], Transaction] | None:
        return None  # across a network; SQLite's store overrides it

    @contextmanager
    def _transaction(self, session: AbstractContextManager[Cursor]) -> Iterator[Transaction]:
        with session as cursor:
            tx = SqlTransaction(Runner(self._dialect, cursor), self._clock())
            yield tx
            if tx.failed:
                # The block caught a StoreError and carried on: its writes cannot stand.
                raise StoreError(
                    f"{self._dialect.name} store: transaction rolled back because a store"
                    " error inside it was caught and ignored",
                )

    def run(self, work: Callable[[Transaction], T], *, attempts: int = 5) -> T:
        for attempt in range(1, attempts + 1):
            try:
                with self.transaction() as tx:
                    return work(tx)
            except StoreError as exc:
                if not exc.retriable or attempt >= attempts:
                    raise
                # Jittered backoff so the transactions that collided do not collide again.
                time.sleep(random.uniform(0, 0.01 * 2**attempt))
        raise AssertionError("unreachable")

    @contextmanager
    def _short(self, *, write: bool = True) -> Iterator[Runner]:
        with self._session(write=write) as cursor:
            yield Runner(self._dialect, cursor)

    def _ts(self, value: datetime) -> Any:
        return self._dialect.ts_in(value)

    # ---- outbox relay -------------------------------------------------------------

    def outbox_claim(
        self,
        relay_id: str,
        limit: int,
        lease_seconds: float,
        *,
        mark_sent: Sequence[int] = (),
    ) -> list[OutboxRow]:
        if limit <= 0 and not mark_sent:
            return []
        now = self._clock()
        with self._relay_session() as cursor:
            run = Runner(self._dialect, cursor)
            # One commit for both: a relay marks a batch sent as it claims the next.
            self._mark_sent(run, mark_sent, now)
            rows = self._claim(run, relay_id, limit, now + timedelta(seconds=lease_seconds), now)
        # Read into objects after the commit: the lock is not held meanwhile.
        rows.sort(key=_first)  # RETURNING's order is not promised
        ts_out = self._dialect.ts_out
        return [
            OutboxRow(int(r[0]), r[1], r[2], bytes(r[3]), load_headers(r[4]), int(r[5]),
                      cast(OutboxState, r[6]), ts_out(r[7]))
            for r in rows
        ]  # fmt: skip

    def outbox_mark_sent(self, ids: Sequence[int]) -> None:
        with self._relay_session() as cursor:
            self._mark_sent(Runner(self._dialect, cursor), ids, self._clock())

    def _relay_session(self) -> AbstractContextManager[Cursor]:
        """A write session for the relay's leases and sent marks. A backend may commit it
        without waiting for the disk: if a power cut loses one, the rows are published
        again after their lease and the server's duplicate window drops the copies."""
        return self._session(write=True)

    def _claim(
        self, run: Runner, relay_id: str, limit: int, until: datetime, now: datetime
    ) -> list[tuple[Any, ...]]:
        if limit <= 0:
            return []
        # One index range per kind of due row (the state index is ordered by id), so a
        # claim reads about ``limit`` rows instead of sorting every due row.
        lock = self._dialect.skip_locked
        due = " UNION ALL ".join(
            f"SELECT id FROM (SELECT id FROM meshforge_outbox WHERE {cond} ORDER BY id LIMIT ?{lock}) d{i}"
            for i, cond in enumerate((
                "state = 'pending'",
                "state = 'publishing' AND lease_until <= ?",
                "state = 'failed' AND given_up_at IS NULL AND retry_at <= ?",
            ))
        )  # fmt: skip
        sql = (
            "UPDATE meshforge_outbox SET state = 'publishing', lease_owner = ?,"
            " lease_until = ?, updated_at = ? WHERE id IN ("
            f" SELECT id FROM ({due}) due ORDER BY id LIMIT ?)"
            f" RETURNING {_OUTBOX_COLUMNS}"
        )
        n = self._ts(now)
        return run.rows(sql, (relay_id, self._ts(until), n, limit, n, limit, n, limit, limit))

    def _mark_sent(self, run: Runner, ids: Sequence[int], now: datetime) -> None:
        n = self._ts(now)
        for start in range(0, len(ids), 500):
            chunk = list(ids[start : start + 500])
            run.count(
                "UPDATE meshforge_outbox SET state = 'sent', sent_at = ?, updated_at = ?,"
                f" lease_owner = NULL, lease_until = NULL WHERE id IN {in_clause(len(chunk))}",
                (n, n, *chunk),
            )

    def outbox_mark_failed(
        self, id: int, error: str, retry_at: datetime, *, give_up: bool = False
    ) -> None:
        now = self._ts(self._clock())
        with self._short() as run:
            changed = run.count(
                "UPDATE meshforge_outbox SET state = 'failed', attempts = attempts + 1,"
                " error = ?, retry_at = ?, given_up_at = ?, updated_at = ?,"
                " lease_owner = NULL, lease_until = NULL WHERE id = ?",
                (clean_text(error), None if give_up else self._ts(retry_at),
                 now if give_up else None, now, id),
            )  # fmt: skip
        if changed == 0:
            raise StoreError(f"no outbox row with id {id}", kind="not_found")

    def outbox_depth(self) -> int:
        with self._short(write=False) as run:
            rows = run.rows(
                "SELECT count(*) FROM meshforge_outbox WHERE state IN ('pending', 'publishing')"
                " OR (state = 'failed' AND given_up_at IS NULL)"
            )
        return int(rows[0][0])

    def outbox_cleanup(self, older_than: datetime) -> int:
        with self._short() as run:
            return run.count(
                "DELETE FROM meshforge_outbox WHERE state = 'sent' AND sent_at < ?",
                (self._ts(older_than),),
            )

    # ---- retention ----------------------------------------------------------------

    def inbox_cleanup(self, older_than: datetime) -> int:
        with self._short() as run:
            return run.count(
                "DELETE FROM meshforge_inbox WHERE status IN ('processed', 'failed')"
                " AND updated_at < ?",
                (self._ts(older_than),),
            )

    def effects_cleanup(self, older_than: datetime) -> int:
        with self._short() as run:
            deleted = run.count(
                "DELETE FROM meshforge_effects WHERE created_at < ?", (self._ts(older_than),)
            )
            # A sequence is never given again: runs before the oldest kept cover nothing.
            run.count(_RUNS_CLEANUP)
            return deleted

    def node_replies_cleanup(self, older_than: datetime) -> int:
        """Delete node replies stored before ``older_than``; returns how many."""
        with self._short() as run:
            return run.count(
                "DELETE FROM meshforge_node_replies WHERE created_at < ?",
                (self._ts(older_than),),
            )

    # ---- streaming readers --------------------------------------------------------

    def events_read(
        self,
        agent: str,
        after: int = 0,
        limit: int | None = None,
        *,
        scope: Scope = DEFAULT_SCOPE,
    ) -> Iterator[StoredEvent]:
        last, remaining = after, limit
        while remaining is None or remaining > 0:
            size = self.page_size if remaining is None else min(self.page_size, remaining)
            with self._short(write=False) as run:
                rows = run.rows(
                    f"SELECT {_EVENT_COLUMNS} FROM meshforge_events WHERE tenant = ?"
                    " AND namespace = ? AND agent = ? AND position > ? ORDER BY position LIMIT ?",
                    (scope.tenant, scope.namespace, agent, last, size),
                )
            for r in rows:
                yield StoredEvent(
                    event_id=r[0], type=r[1], resource_id=r[2], command_id=r[3], key=r[4],
                    data=bytes(r[5]), ts=r[6], agent=r[7], position=int(r[8]),
                    stored_at=self._dialect.ts_out(r[9]), scope=Scope(r[10], r[11]),
                )  # fmt: skip
            if len(rows) < size:
                return
            last = int(rows[-1][8])
            remaining = None if remaining is None else remaining - len(rows)

    def agents(self) -> list[str]:
        with self._short(write=False) as run:
            rows = run.rows("SELECT DISTINCT agent FROM meshforge_agent_heads ORDER BY agent")
        return [r[0] for r in rows]

    def logs(self, agent: str | None = None) -> list[tuple[Scope, str]]:
        where, params = (" WHERE agent = ?", (agent,)) if agent is not None else ("", ())
        with self._short(write=False) as run:
            rows = run.rows(
                f"SELECT tenant, namespace, agent FROM meshforge_agent_heads{where}"
                " ORDER BY tenant, namespace, agent",
                params,
            )
        return [(Scope(r[0], r[1]), r[2]) for r in rows]

    def effects_read(self, consumer: str | None = None) -> Iterator[EffectRecord]:
        d = self._dialect
        last = 0
        mine, params = (" AND e.consumer = ?", [consumer]) if consumer is not None else ("", [])
        while True:
            with self._short(write=False) as run:
                rows = run.rows(
                    "SELECT e.seq, e.consumer, e.key, e.command_id, e.created_at,"
                    f" {PUBLISHED_AT}, e.outputs, e.tenant, e.namespace"
                    f" FROM meshforge_effects e WHERE e.seq > ?{mine} ORDER BY e.seq LIMIT ?",
                    (last, *params, self.page_size),
                )
            records = [
                EffectRecord(
                    consumer=r[1],
                    key=r[2],
                    command_id=r[3],
                    outputs=tuple(unpack_outputs(r[6])),
                    created_at=d.ts_out(r[4]),
                    published_at=None if r[5] is None else d.ts_out(r[5]),
                    scope=Scope(r[7], r[8]),
                )
                for r in rows
            ]
            yield from records
            if len(records) < self.page_size:
                return
            last = int(rows[-1][0])

    def inbox_read(
        self, consumer: str | None = None, *, status: InboxStatus | None = None
    ) -> Iterator[InboxRecord]:
        after: tuple[str, str, str, str] | None = None
        while True:
            where, params = _keyset(consumer, after)
            if status is not None:
                where = f"{where} AND status = ?" if where else " WHERE status = ?"
                params = [*params, status]
            with self._short(write=False) as run:
                rows = run.rows(
                    f"SELECT {INBOX_COLUMNS} FROM meshforge_inbox{where}"
                    " ORDER BY tenant, namespace, consumer, key LIMIT ?",
                    (*params, self.page_size),
                )
            records = [inbox_record(self._dialect, r) for r in rows]
            yield from records
            if len(records) < self.page_size:
                return
            last = records[-1]
            after = (last.scope.tenant, last.scope.namespace, last.consumer, last.key)

    def nodes(self) -> list[NodeInfo]:
        with self._short(write=False) as run:
            rows = run.rows(
                "SELECT site, node, epoch, updated_at FROM meshforge_node_epochs"
                " ORDER BY site, node"
            )
        return [NodeInfo(r[0], r[1], int(r[2]), self._dialect.ts_out(r[3])) for r in rows]


def _keyset(consumer: str | None, after: tuple[str, str, str, str] | None) -> tuple[str, list[Any]]:
    """WHERE clause for the next page of a table keyed by (tenant, namespace, consumer, key)."""
    clauses: list[str] = []
    params: list[Any] = []
    if consumer is not None:
        clauses.append("consumer = ?")
        params.append(consumer)
    if after is not None:
        clauses.append("(tenant, namespace, consumer, key) > (?, ?, ?, ?)")
        params.extend(after)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params
