"""The PostgreSQL backend: psycopg 3 with a ``psycopg_pool.ConnectionPool``.

Each transaction borrows a pooled connection, so many threads work side by side. Rows
are locked where two workers could collide (inbox rows, event heads, resource state);
outbox relays claim with ``FOR UPDATE SKIP LOCKED`` and never wait on each other. A
serialisation failure or deadlock raises ``StoreError(retriable=True)``: run the whole
transaction again (``Store.run`` does).

URL options, besides everything libpq accepts: ``schema`` (created if missing, put first
on the search path) and ``pool_size`` (default 10). Batches are written with COPY and
read with one array per key column. A transaction opens in pipeline mode, so an engine's
group costs two round trips: BEGIN with its reads, and its writes with the COMMIT
(``meshforge.store.logtail``).

Example::

    store = open_store("postgresql://meshforge@db:5432/meshforge?schema=prod&pool_size=20")
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, cast
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool, PoolTimeout

from meshforge.errors import StoreError, one_line
from meshforge.store.base import NewEffect, NewEvent, Scoped, StoredOutput, Transaction
from meshforge.store.batch import EFFECTS_GET, EFFECTS_MARK_PUBLISHED, STATES_GET, lock_names
from meshforge.store.core import Clock, Durability, SqlStore
from meshforge.store.logtail import DuplicateEffect
from meshforge.store.packing import pack_outputs, unpack_outputs
from meshforge.store.schema import migrate
from meshforge.store.sql import (
    Cursor,
    Dialect,
    Runner,
    qmark_to_format,
    redact,
    spoils,
    url_error,
    utc,
)
from meshforge.store.transaction import SqlTransaction
from meshforge.topology.scope import DEFAULT_SCOPE, Scope

SCHEMES = ("postgresql://", "postgres://")
# An array parameter (``?::text[]``) goes in binary: psycopg writes an array's text form in
# Python, quoting every element (a list of 1,024 keys took 2 ms, of 1,024 byte strings
# 8.6 ms), and its binary form at C speed (0.5 and 0.6 ms).
_ARRAY_PARAM = re.compile(r"%s(::\w+\[\])")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
# Advisory lock class ids: one for schema migrations, one for per-resource state locks.
_MIGRATION_LOCK = 0x4D46
_RESOURCE_LOCK = 0x4D47
_CONNECT_TIMEOUT = 10


# A server's state, never the data's (disk full and the like are OperationalError already).
_OUTAGES = pg_errors.ReadOnlySqlTransaction


def _to_store_error(exc: Exception) -> StoreError:
    text = f"postgresql store: {one_line(exc)}"
    if isinstance(exc, pg_errors.UniqueViolation):
        return StoreError(text, kind="duplicate")
    if isinstance(exc, pg_errors.IntegrityError):
        return StoreError(text, kind="constraint")
    if isinstance(exc, pg_errors.SerializationFailure | pg_errors.DeadlockDetected):
        return StoreError(text, kind="conflict", retriable=True)
    if isinstance(exc, pg_errors.LockNotAvailable):
        return StoreError(text, kind="busy", retriable=True)
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError | _OUTAGES):
        # Down, unreachable, disk full, read-only (a standby): the worker's kill switch waits.
        return StoreError(text, kind="unavailable", retriable=True)
    if isinstance(exc, psycopg.DataError):
        # NUL in text, a bad encoding, a number out of range: this data can never be stored.
        if isinstance(exc, pg_errors.CharacterNotInRepertoire) and "0x00" in str(exc):
            text = f"postgresql store: text cannot contain NUL (0x00) characters ({one_line(exc)})"
        return StoreError(text, kind="invalid")
    return StoreError(text)


def _first_error(exc: psycopg.Error) -> psycopg.Error:
    """The error that aborted a pipeline, not a later statement's "pipeline aborted" (which
    psycopg may raise instead while it reads the results after the first error)."""
    while isinstance(exc, pg_errors.PipelineAborted) and isinstance(exc.__context__, psycopg.Error):
        exc = exc.__context__
    return exc


def _copy_in(cursor: Cursor, target: str, rows: Sequence[Sequence[Any]]) -> None:
    with cast("psycopg.Cursor[Any]", cursor).copy(f"COPY {target} FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)


def _execute_fresh(cursor: Cursor, sql: str, params: Sequence[Any]) -> None:
    # Never a prepared (generic) plan: one made while the tables were small (a seq scan)
    # would outlive their growth until an ANALYZE, which may never come.
    cast("psycopg.Cursor[Any]", cursor).execute(sql, params, prepare=False)


def _ts_out(value: datetime) -> datetime:
    return value.astimezone(UTC)


# In hash order, so two transactions locking overlapping sets cannot deadlock; the lock
# call runs after the sort (PostgreSQL evaluates volatile output columns last).
_LOCK_RESOURCES = (
    f"SELECT pg_advisory_xact_lock({_RESOURCE_LOCK}, h)"
    " FROM (SELECT DISTINCT hashtext(n) AS h FROM unnest(?::text[]) AS u(n)) AS l ORDER BY h"
)


@lru_cache(maxsize=512)
def _to_pyformat(sql: str) -> str:
    """``qmark_to_format``, with array parameters sent in binary (``%b``)."""
    return _ARRAY_PARAM.sub(r"%b\1", qmark_to_format(sql))


DIALECT = Dialect(
    name="postgresql",
    types={
        "ts": "TIMESTAMPTZ",
        "blob": "BYTEA",
        "id": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
    },
    ts_in=utc,
    ts_out=_ts_out,
    to_store_error=_to_store_error,
    driver_errors=(psycopg.Error,),
    translate=_to_pyformat,
    for_update=" FOR UPDATE",
    skip_locked=" FOR UPDATE SKIP LOCKED",
    resource_lock=f"SELECT pg_advisory_xact_lock({_RESOURCE_LOCK}, hashtext(?))",
    resources_lock=_LOCK_RESOURCES,
    migration_lock=f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK}, 0)",
    max_params=65535,
    copy_in=_copy_in,
    execute_fresh=_execute_fresh,
    arrays=True,
)


# The log's head moves, the events go in and the states are stored in one statement: the
# head row, which every writer of the (scope, agent) log waits for until COMMIT, is taken
# by the statement that also does everything else under it.
_HEAD = """
WITH head AS (
    INSERT INTO meshforge_agent_heads (tenant, namespace, agent, position) VALUES (?, ?, ?, ?)
    ON CONFLICT (tenant, namespace, agent) DO UPDATE
    SET position = meshforge_agent_heads.position + excluded.position
    RETURNING position
), appended AS (
    INSERT INTO meshforge_events (tenant, namespace, agent, position, event_id, type,
        resource_id, command_id, key, data, ts, stored_at)
    SELECT ?, ?, ?, head.position - ? + u.n, u.event_id, u.type, u.resource_id, u.command_id,
        u.key, u.data, u.ts, ?
    FROM head, unnest(?::text[], ?::text[], ?::text[], ?::text[], ?::text[], ?::bytea[],
        ?::text[]) WITH ORDINALITY AS u(event_id, type, resource_id, command_id, key, data, ts, n)
)"""
_APPEND = _HEAD + " SELECT position FROM head"
_APPEND_WITH_STATES = (
    _HEAD
    + """, stored AS (
    INSERT INTO meshforge_states (tenant, namespace, agent, resource_id, data, position,
        updated_at)
    SELECT ?, ?, ?, s.r, s.d, head.position - ? + s.i, ?
    FROM head, unnest(?::text[], ?::bytea[], ?::bigint[]) AS s(r, d, i)
    ON CONFLICT (tenant, namespace, agent, resource_id) DO UPDATE
    SET data = excluded.data, position = excluded.position, updated_at = excluded.updated_at
) SELECT position FROM head"""
)


def _append_params(
    agent: str, scope: Scope, events: Sequence[NewEvent], now: Any
) -> tuple[Any, ...]:
    t, ns, count = scope.tenant, scope.namespace, len(events)
    return (
        t, ns, agent, count, t, ns, agent, count, now,
        [e.event_id for e in events], [e.type for e in events],
        [e.resource_id for e in events], [e.command_id for e in events],
        [e.key for e in events], [bytes(e.data) for e in events], [e.ts for e in events],
    )  # fmt: skip


_EFFECTS_PUT = (
    "INSERT INTO meshforge_effects (tenant, namespace, consumer, key, command_id, created_at,"
    " outputs) SELECT u.t, u.n, ?, u.k, u.c, ?, u.o"
    " FROM unnest(?::text[], ?::text[], ?::text[], ?::text[], ?::bytea[]) AS u(t, n, k, c, o)"
)
_STATES_LOCKED = STATES_GET + " FOR UPDATE OF s"


class _Lead(Runner):
    """The runner of a transaction that opened in pipeline mode, BEGIN not yet sent: the
    first statement run the plain way leaves the pipeline (BEGIN goes out with it)."""

    def __init__(self, cursor: Cursor, leave: Callable[[], object]) -> None:
        super().__init__(DIALECT, cursor)
        self.leave: Callable[[], object] | None = leave

    def _ensure_open(self) -> None:
        super()._ensure_open()
        if self.leave is not None:
            leave, self.leave = self.leave, None
            try:
                leave()
            except psycopg.Error as exc:
                self.failed = True
                raise _to_store_error(exc) from exc


class _Sealed(Runner):
    """The runner of a transaction whose last writes go out with the COMMIT."""

    def _ensure_open(self) -> None:
        raise StoreError(
            "postgresql store: the transaction's tail (effects, event log) was sent with the"
            " commit; nothing but further appends may follow it in the transaction"
        )


class PostgresTransaction(SqlTransaction):
    """The store's transaction on PostgreSQL: a ``LogTail`` (``meshforge.store.logtail``).

    It opens in pipeline mode, BEGIN queued: ``states_and_effects_get`` sends it with the
    reads and waits once, and any other statement leaves the pipeline first. The tail
    (``effects_put_with_commit``, ``append_log``) is sent in pipeline mode, its results
    read with the COMMIT's when the transaction ends."""

    def __init__(
        self, conn: psycopg.Connection[Any], cursor: psycopg.Cursor[Any],
        pipelines: ExitStack, pipeline: psycopg.Pipeline, now: datetime,
    ) -> None:  # fmt: skip
        super().__init__(_Lead(cursor, self._leave), now)
        self._conn = conn
        self._cursor = cursor
        self._pipelines = pipelines  # closed with the transaction, after its COMMIT
        self._pipeline: psycopg.Pipeline | None = pipeline
        self._effects_of: str | None = None  # the consumer whose effects go with the COMMIT

    def error(self, exc: psycopg.Error) -> StoreError:
        """The store's error for a driver error of this transaction or of its COMMIT."""
        exc = _first_error(exc)
        if (
            self._effects_of is not None and isinstance(exc, pg_errors.UniqueViolation)
            and exc.diag.table_name == "meshforge_effects"
        ):  # fmt: skip
            what = f"a key is already stored ({_to_store_error(exc)})"
            return DuplicateEffect(str(self._duplicate(self._effects_of, what)))
        return _to_store_error(exc)

    @spoils
    def events_append(
        self, agent: str, events: Sequence[NewEvent], *, scope: Scope = DEFAULT_SCOPE
    ) -> list[int]:
        if not events:
            return []
        head = self._run.rows(_APPEND, _append_params(agent, scope, events, self._now))
        first = int(head[0][0]) - len(events) + 1
        return list(range(first, first + len(events)))

    @spoils
    def states_and_effects_get(
        self, agent: str, resources: Sequence[Scoped], consumer: str, keys: Sequence[Scoped]
    ) -> tuple[dict[Scoped, bytes | None], dict[Scoped, list[StoredOutput] | None]]:
        pipeline = self._pipeline
        if pipeline is None or not isinstance(self._run, _Lead):
            return self.states_get(agent, resources), self.effects_get(consumer, keys)
        Runner._ensure_open(self._run)  # a failed transaction refuses; the pipeline stays
        slots, wanted = sorted(set(resources)), sorted(set(keys))
        states: dict[Scoped, bytes | None] = dict.fromkeys(slots)
        effects: dict[Scoped, list[StoredOutput] | None] = dict.fromkeys(wanted)
        # A cursor for each result: all of them (and BEGIN's) come back with one sync.
        with (
            self._sending(),
            self._conn.cursor() as found_states,
            self._conn.cursor() as found_effects,
        ):
            if slots:
                self._cursor.execute(DIALECT.sql(_LOCK_RESOURCES), (lock_names(agent, slots),))
                self._send(
                    found_states,
                    _STATES_LOCKED,
                    [(s.tenant, s.namespace, agent, r) for s, r in slots],
                )
            if wanted:
                self._send(
                    found_effects,
                    EFFECTS_GET,
                    [(s.tenant, s.namespace, consumer, k) for s, k in wanted],
                )
            pipeline.sync()
            state_rows = found_states.fetchall() if slots else []
            effect_rows = found_effects.fetchall() if wanted else []
        for tenant, namespace, resource_id, data in state_rows:
            states[(Scope(tenant, namespace), resource_id)] = bytes(data)
        for tenant, namespace, key, outputs in effect_rows:
            effects[(Scope(tenant, namespace), key)] = unpack_outputs(outputs)
        return states, effects

    @spoils
    def effects_put_with_commit(
        self, consumer: str, effects: Sequence[NewEffect], marks: Sequence[Scoped]
    ) -> None:
        if not effects and not marks:
            return
        self._distinct_keys(consumer, effects)
        self._seal()
        with self._sending():
            if effects:
                self._effects_of = consumer
                self._cursor.execute(DIALECT.sql(_EFFECTS_PUT), (
                    consumer, self._now, [e.scope.tenant for e in effects],
                    [e.scope.namespace for e in effects], [e.key for e in effects],
                    [e.command_id for e in effects], [pack_outputs(e.outputs) for e in effects],
                ))  # fmt: skip
            if marks:
                rows = [(s.tenant, s.namespace, consumer, k) for s, k in sorted(set(marks))]
                self._send(self._cursor, EFFECTS_MARK_PUBLISHED, rows, (self._now,))

    @spoils
    def append_log(
        self, agent: str, scope: Scope, events: Sequence[NewEvent],
        states: Sequence[tuple[str, bytes, int]],
    ) -> None:  # fmt: skip
        if not events:
            return
        self._seal()
        count = len(events)
        params = (
            *_append_params(agent, scope, events, self._now),
            scope.tenant, scope.namespace, agent, count, self._now,
            [r for r, _, _ in states], [bytes(d) for _, d, _ in states], [i + 1 for _, _, i in states],
        )  # fmt: skip
        with self._sending():
            self._cursor.execute(DIALECT.sql(_APPEND_WITH_STATES), params)

    def _leave(self) -> None:
        """Leave the pipeline the transaction opened in (its results are read first)."""
        self._pipeline = None
        self._pipelines.close()

    def _seal(self) -> None:
        """From here on, statements are sent, not waited for: their results (errors) are
        read with the COMMIT's."""
        if isinstance(self._run, _Sealed):
            return
        Runner._ensure_open(self._run)  # a failed transaction refuses; the pipeline stays
        if self._pipeline is None:
            self._pipeline = self._pipelines.enter_context(self._conn.pipeline())
        self._run = _Sealed(DIALECT, self._cursor)

    def _send(
        self, cursor: psycopg.Cursor[Any], sql: str, rows: Sequence[Sequence[Any]],
        fixed: Sequence[Any] = (),
    ) -> None:  # fmt: skip
        """Send a ``Runner.each`` statement in pipeline mode; its rows arrive on ``cursor``."""
        for text, params, _ in self._run.statements(sql, rows, fixed):
            cursor.execute(DIALECT.sql(text), params, prepare=False)

    @contextmanager
    def _sending(self) -> Iterator[None]:
        """Around driver calls in pipeline mode: their errors (maybe an earlier statement's)
        become the store's."""
        try:
            yield
        except psycopg.Error as exc:
            raise self.error(exc) from exc
        except (UnicodeError, OverflowError) as exc:  # a value the driver cannot even send
            raise StoreError(f"postgresql store: {one_line(exc)}", kind="invalid") from exc


def _commit_unsynced(conninfo: str) -> str:
    """``conninfo`` with ``synchronous_commit = off``: a commit returns before its WAL
    reaches the disk (a killed worker loses nothing; a crash of the database server or
    its machine may undo the last few hundred milliseconds of commits)."""
    options = str(conninfo_to_dict(conninfo).get("options") or "")
    return make_conninfo(conninfo, options=f"{options} -c synchronous_commit=off".strip())


def parse_url(url: str) -> tuple[str, str | None, int]:
    """``(libpq conninfo, schema, pool_size)`` from a ``postgresql://`` URL."""
    if not url.startswith(SCHEMES):
        raise url_error(url, "a PostgreSQL URL starts with postgresql://")
    parts = urlsplit(url)
    schema: str | None = None
    pool_size = 10
    rest: list[tuple[str, str]] = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == "schema":
            if not _IDENTIFIER.fullmatch(value):
                raise url_error(url, f"schema {value!r} is not a plain SQL identifier")
            schema = value
        elif name == "pool_size":
            if not value.isdigit() or int(value) < 1:
                raise url_error(url, f"pool_size {value!r} is not a positive integer")
            pool_size = int(value)
        else:
            rest.append((name, value))
    # %20, not "+": libpq does not read "+" as a space (options="-c a=b -c c=d").
    base = urlunsplit(parts._replace(query=urlencode(rest, quote_via=quote)))
    try:
        params = conninfo_to_dict(base)
    except psycopg.ProgrammingError as exc:
        raise url_error(url, one_line(exc)) from exc
    extra: dict[str, str | int] = {}
    if "connect_timeout" not in params:
        extra["connect_timeout"] = _CONNECT_TIMEOUT
    if schema is not None:
        options = str(params.get("options") or "")
        extra["options"] = f"{options} -c search_path={schema}".strip()
    return make_conninfo(base, **extra), schema, pool_size


# A connection that committed this recently is handed out without the pool's check (an
# empty query: one more round trip per transaction). If the server went away meanwhile,
# the transaction fails as retriable ("unavailable") and the pool drops the connection.
_CHECK_AFTER = 1.0


class _Checks:
    """The pool's ``check``: ``check_connection``, unless the connection committed within
    ``_CHECK_AFTER`` seconds and is idle."""

    def __init__(self) -> None:
        self._used: weakref.WeakKeyDictionary[psycopg.Connection[Any], float] = (
            weakref.WeakKeyDictionary()
        )

    def __call__(self, conn: psycopg.Connection[Any]) -> None:
        used = self._used.get(conn)
        if (
            used is None
            or time.monotonic() - used > _CHECK_AFTER
            or conn.info.transaction_status != pq.TransactionStatus.IDLE
        ):
            ConnectionPool.check_connection(conn)

    def committed(self, conn: psycopg.Connection[Any]) -> None:
        self._used[conn] = time.monotonic()


class PostgresStore(SqlStore):
    """The store in a PostgreSQL database (one schema of it)."""

    transaction_type = PostgresTransaction

    def __init__(
        self, url: str, *, clock: Clock | None = None, durability: Durability = "sync"
    ) -> None:
        super().__init__(url, DIALECT, clock)
        conninfo, schema, pool_size = parse_url(url)
        if durability == "os":
            conninfo = _commit_unsynced(conninfo)
        self._pool: ConnectionPool | None = None
        self._checks = _Checks()
        # A direct first connection gives a clear reason if the server is unreachable.
        try:
            with (
                psycopg.connect(conninfo, autocommit=True) as conn,
                conn.transaction(),
                conn.cursor() as cur,
            ):
                if schema is not None:
                    cur.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
                migrate(Runner(DIALECT, cur), DIALECT, self._clock())
        except psycopg.Error as exc:
            raise StoreError(
                f"cannot open PostgreSQL store {self._safe_url()!r}: {one_line(exc)}",
                kind="unavailable",
                retriable=isinstance(exc, psycopg.OperationalError),
            ) from exc
        pool = ConnectionPool(
            conninfo,
            min_size=1,
            max_size=pool_size,
            kwargs={"autocommit": True},
            check=self._checks,
            name="meshforge-store",
            open=False,
        )
        try:
            pool.open(wait=True, timeout=_CONNECT_TIMEOUT)
        except PoolTimeout as exc:
            pool.close()
            raise StoreError(
                f"cannot open PostgreSQL store {self._safe_url()!r}: pool did not connect",
                kind="unavailable",
                retriable=True,
            ) from exc
        self._pool = pool

    def _safe_url(self) -> str:
        return redact(self.url)

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        pool = self._pool
        if pool is None:
            raise StoreError("postgresql store is closed", kind="closed")
        tx: PostgresTransaction | None = None
        try:
            with pool.connection() as conn:
                try:
                    # The transaction opens in pipeline mode; the pipeline it is in at its
                    # end (that one, or its tail's) sends the COMMIT along, then reads
                    # every result. (Not conn.transaction(): in pipeline mode, it waits
                    # for the server at its start and its end.)
                    with ExitStack() as pipelines:
                        pipeline = pipelines.enter_context(conn.pipeline())
                        with psycopg.Transaction(conn), conn.cursor() as cur:
                            tx = PostgresTransaction(conn, cur, pipelines, pipeline, self._clock())
                            yield tx
                            if tx.failed:
                                raise StoreError(
                                    "postgresql store: transaction rolled back because a store"
                                    " error inside it was caught and ignored",
                                )
                    self._checks.committed(conn)
                except psycopg.Error:
                    # A tail that failed leaves its transaction aborted, not committed.
                    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
                        conn.rollback()
                    raise
        except psycopg.Error as exc:
            raise (_to_store_error(_first_error(exc)) if tx is None else tx.error(exc)) from exc

    @contextmanager
    def _session(self, *, write: bool) -> Iterator[Cursor]:
        pool = self._pool
        if pool is None:
            raise StoreError("postgresql store is closed", kind="closed")
        try:
            with pool.connection() as conn:
                with conn.transaction(), conn.cursor() as cur:
                    yield cur
                self._checks.committed(conn)
        except psycopg.Error as exc:
            # Checkout, BEGIN and COMMIT errors; statement errors arrive as StoreError.
            raise _to_store_error(exc) from exc

    def _release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
