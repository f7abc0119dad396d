"""The SQLite backend: the default store, one file beside the program (or in memory).

One connection in WAL mode; a lock lets one thread at a time hold a transaction, and
``BEGIN IMMEDIATE`` plus ``busy_timeout`` make other processes wait their turn to write.
Readers in WAL mode never block the writer.

URL query option: ``busy_timeout`` (milliseconds, default 5000). The ``durability``
setting picks ``PRAGMA synchronous``: ``sync`` is FULL (a commit survives a power cut),
``os`` is NORMAL (it survives a killed process only); the URL option ``synchronous`` is
the older spelling of the same choice and may not contradict it.
The outbox relay's own commits (leases, sent marks) are ``normal`` in WAL mode: a power
cut may undo the last of them, and those rows are published again (deduplicated).

Example::

    store = open_store("sqlite:///.meshforge/store.db?busy_timeout=10000")
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from meshforge.errors import StoreError, one_line
from meshforge.store.base import Transaction
from meshforge.store.core import Clock, Durability, SqlStore
from meshforge.store.schema import migrate
from meshforge.store.sequencing import DIGEST_FUNCTION, digest
from meshforge.store.sql import Cursor, Dialect, sqlite_ts_in, sqlite_ts_out, url_error

log = logging.getLogger("meshforge.store")

PREFIX = "sqlite:///"
MEMORY = ":memory:"
# RETURNING and upsert need 3.35.
_MIN_VERSION = (3, 35, 0)
# A commit checkpoints the WAL itself past this many frames (4 KiB pages, 16 MiB). By then
# the checkpoint thread has copied all but the last few commits' pages, so that is quick,
# and it lets the WAL start again from its beginning even while commits never pause.
_BACKSTOP_FRAMES = 4_000
# Pages the connection keeps in memory (KiB, SQLite's negative form): a group of 256
# commands dirties some 700 pages, beyond the default 2 MiB, and what a full cache sheds
# is read again (and spilled into the WAL before the COMMIT). With 32 MiB a stage of
# 10,240 commands read 40% fewer bytes (``bench_store.py --stage``); it is an upper bound,
# filled only as the database grows.
_CACHE_KIB = 32 * 1024
# Prepared statements kept: the multi-row writes come in a few shapes each (see
# ``Dialect.embedded``), more than the driver's default of 128 in all.
_STATEMENTS = 256
# How often the checkpoint thread copies what the WAL holds into the database, and how
# soon again after a round that found the WAL past an eighth of the backstop.
_CHECKPOINT_EVERY, _CHECKPOINT_SOON = 0.2, 0.02
# Checkpoints in a row at most, each copying what commits wrote during the one before.
_CATCH_UP = 8


# Result codes (and their extended forms) that say the database cannot be written now:
# disk full, read-only file or mount, I/O errors, a file that cannot be opened.
_OUTAGES = ("SQLITE_FULL", "SQLITE_READONLY", "SQLITE_IOERR", "SQLITE_CANTOPEN")


class _WouldWait(Exception):
    """A transaction asked for without waiting could not begin at once."""


def _to_store_error(exc: Exception) -> StoreError:
    text = f"sqlite store: {one_line(exc)}"
    if isinstance(exc, sqlite3.IntegrityError):
        kind = "duplicate" if "UNIQUE" in str(exc) or "PRIMARY KEY" in str(exc) else "constraint"
        return StoreError(text, kind=kind)
    if isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc)):
        return StoreError(text, kind="busy", retriable=True)
    if isinstance(exc, sqlite3.DataError):
        return StoreError(text, kind="invalid")  # e.g. a string or blob too big
    if getattr(exc, "sqlite_errorname", "").startswith(_OUTAGES):
        # The disk or the file, not the data: the worker's kill switch waits for it.
        return StoreError(text, kind="unavailable", retriable=True)
    return StoreError(text)


DIALECT = Dialect(
    name="sqlite",
    types={
        "ts": "TEXT",
        "blob": "BLOB",
        "id": "INTEGER PRIMARY KEY AUTOINCREMENT",
    },
    ts_in=sqlite_ts_in,
    ts_out=sqlite_ts_out,
    to_store_error=_to_store_error,
    driver_errors=(sqlite3.Error,),
    # SQLite_MAX_VARIABLE_NUMBER: 32766 since 3.32, 999 before.
    max_params=32766 if sqlite3.sqlite_version_info >= (3, 32, 0) else 999,
    embedded=True,
)


_SYNCHRONOUS: dict[str, str] = {"sync": "full", "os": "normal"}


def parse_url(url: str, durability: Durability = "sync") -> tuple[str, int, str]:
    """``(path or ":memory:", busy_timeout_ms, synchronous)`` from a ``sqlite:///`` URL.

    ``synchronous`` follows ``durability`` (``sync``: FULL, ``os``: NORMAL); the URL's
    ``synchronous`` option is its older spelling and may not contradict it."""
    if not url.startswith(PREFIX):
        raise url_error(url, "a SQLite URL starts with sqlite:/// (three slashes)")
    parts = urlsplit(url)
    path = parts.path[1:]
    if not path:
        raise url_error(url, "no database path after sqlite:///")
    busy, synchronous = 5000, _SYNCHRONOUS[durability]
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == "busy_timeout" and value.isdigit():
            busy = int(value)
        elif name == "synchronous" and value.lower() in ("full", "normal"):
            if value.lower() != synchronous:
                raise url_error(
                    url,
                    f"synchronous={value} contradicts durability {durability!r}: set"
                    f" durability = {'sync' if value.lower() == 'full' else 'os'} instead",
                )
        else:
            raise url_error(
                url,
                f"unknown option {name}={value!r} (busy_timeout=<ms>, synchronous=full|normal)",
            )
    return path, busy, synchronous


def _to_wal(conn: sqlite3.Connection, within: float) -> str:
    """``PRAGMA journal_mode = WAL``, waiting up to ``within`` seconds for a writer: the
    switch fails at once while another connection (say a second worker creating the same
    store) holds a lock, without consulting ``busy_timeout``. Returns the mode now set."""
    deadline = time.monotonic() + within
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(0.01)  # polling the lock, with the busy_timeout as deadline


class _Checkpointer:
    """Copies the WAL into the database every ``_CHECKPOINT_EVERY`` seconds, on a connection
    and thread of its own.

    A checkpoint writes back every page the WAL holds and syncs the database file: at a
    thousand commands a second, one every 16 MiB of WAL took 10-30 ms, and the commit that
    ran it held every command behind it that long. PASSIVE checkpoints never wait for
    nor block a commit. The WAL starts again from its beginning when a commit finds it
    copied whole, so a round repeats while commits added frames during the one before.
    """

    def __init__(self, path: str) -> None:
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=0)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="meshforge-sqlite-checkpoint", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        every = _CHECKPOINT_EVERY
        while not self._stop.wait(every):
            try:
                last = -1
                for _ in range(_CATCH_UP):
                    # The WAL's size in frames when it began, and how many are copied now.
                    busy, frames, _copied = self._conn.execute(
                        "PRAGMA wal_checkpoint(PASSIVE)"
                    ).fetchall()[0]
                    if busy or frames == last:  # no commit since the round before: all copied
                        break
                    last = frames
                # A WAL growing fast (a thousand commits a second add 2,000 frames in 0.2 s)
                # is copied more often, so it starts again long before a commit's backstop.
                every = _CHECKPOINT_EVERY if last < _BACKSTOP_FRAMES // 8 else _CHECKPOINT_SOON
            except sqlite3.Error as exc:  # locked by another process's checkpoint, say
                log.debug("sqlite checkpoint skipped: %s", one_line(exc))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._conn.close()


class SqliteStore(SqlStore):
    """The store in one SQLite database file (or in memory, for tests)."""

    def __init__(
        self, url: str, *, clock: Clock | None = None, durability: Durability = "sync"
    ) -> None:
        super().__init__(url, DIALECT, clock)
        path, busy_ms, synchronous = parse_url(url, durability)
        if sqlite3.sqlite_version_info < _MIN_VERSION:
            raise StoreError(
                f"SQLite {sqlite3.sqlite_version} is too old for the store; 3.35 or newer needed"
            )
        self._lock = threading.Lock()
        self._busy_s = busy_ms / 1000
        self._checkpointer: _Checkpointer | None = None
        try:
            if path != MEMORY:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._conn: sqlite3.Connection | None = sqlite3.connect(
                path,
                isolation_level=None,
                check_same_thread=False,
                timeout=busy_ms / 1000,
                cached_statements=_STATEMENTS,
            )
            self._conn.execute(f"PRAGMA busy_timeout = {busy_ms}")
            self._wal = path != MEMORY and _to_wal(self._conn, self._busy_s) == "wal"
            self._conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
            self._synchronous = synchronous.upper()
            # Checkpoints (copying the WAL into the database) run in a thread of their own
            # (``_Checkpointer``), so no commit waits for one; a commit checkpoints itself
            # only as a backstop, should the WAL outgrow what that thread keeps up with.
            self._conn.execute(f"PRAGMA wal_autocheckpoint = {_BACKSTOP_FRAMES}")
            self._conn.execute(f"PRAGMA cache_size = -{_CACHE_KIB}")
            # The digest columns of schema 5, for the migration that fills them.
            self._conn.create_function(DIGEST_FUNCTION, 4, digest, deterministic=True)
            if self._wal:
                self._checkpointer = _Checkpointer(path)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open SQLite store {path!r}: {one_line(exc)}") from exc
        try:
            with self._short() as run:
                migrate(run, DIALECT, self._clock())
        except BaseException:
            self._release()
            raise

    @contextmanager
    def _relay_session(self) -> Iterator[Cursor]:
        # In WAL mode with synchronous=NORMAL the commit reaches the disk with the next
        # FULL commit or checkpoint; the application's own transactions stay as set.
        with self._session(write=True, synchronous="NORMAL" if self._wal else None) as cursor:
            yield cursor

    def transaction_now(self) -> tuple[AbstractContextManager[Transaction], Transaction] | None:
        cm = self._transaction(self._session(write=True, wait=False))
        try:
            return cm, cm.__enter__()
        except _WouldWait:
            return None

    @contextmanager
    def _session(
        self, *, write: bool, synchronous: str | None = None, wait: bool = True
    ) -> Iterator[Cursor]:
        # Bounded wait: a transaction left open (or opened inside another) surfaces as a
        # retriable error instead of hanging every thread. Entering and leaving may happen
        # on different threads (asyncio.to_thread), so the lock is not tied to one.
        # ``wait=False``: raise _WouldWait rather than wait for this lock or SQLite's.
        if not wait:
            if not self._lock.acquire(blocking=False):
                raise _WouldWait()
        elif not self._lock.acquire(timeout=self._busy_s):
            raise StoreError(
                f"sqlite store: waited {self._busy_s:g}s for another transaction of this"
                " process to finish (busy_timeout); is one left open, or opened inside another?",
                kind="busy",
                retriable=True,
            )
        relaxed = False  # this session's commit only: set back before the lock goes
        try:
            conn = self._conn
            if conn is None:
                raise StoreError("sqlite store is closed", kind="closed")
            if synchronous is not None and synchronous != self._synchronous:
                conn.execute(f"PRAGMA synchronous = {synchronous}")
                relaxed = True
            if wait:
                self._begin(conn, write)
            else:
                self._begin_now(conn, write)
            try:
                yield conn.cursor()
            except BaseException:
                self._rollback(conn)
                raise
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback(conn)
                raise _to_store_error(exc) from exc
        finally:
            if relaxed and self._conn is not None:
                self._conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            self._lock.release()

    @staticmethod
    def _begin(conn: sqlite3.Connection, write: bool) -> None:
        try:
            # IMMEDIATE takes the write lock up front: no upgrade deadlock mid-transaction.
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        except sqlite3.Error as exc:
            raise _to_store_error(exc) from exc

    def _begin_now(self, conn: sqlite3.Connection, write: bool) -> None:
        """BEGIN, or _WouldWait if another connection (another process) holds the lock."""
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            self._begin(conn, write)
        except StoreError as exc:
            if exc.kind == "busy":
                raise _WouldWait() from exc
            raise
        finally:
            conn.execute(f"PRAGMA busy_timeout = {round(self._busy_s * 1000)}")

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")

    def _release(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
        # Let a transaction in flight finish first, but never hang shutdown on one left open.
        locked = self._lock.acquire(timeout=self._busy_s)
        try:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()
        finally:
            if locked:
                self._lock.release()
