"""``transaction_now``: a transaction begun without waiting, or None where that would wait.

The engine runs a light load's transactions on its event loop this way; a wait there
would stall every message of the worker, so beginning must never wait.
"""

from __future__ import annotations

import sqlite3
import threading
import time

from meshforge.store import Store

NOW = 1.0  # seconds: a fifth of the wait for a lock (busy_timeout is 5 s), far above a stall


def test_sqlite_begins_at_once_and_commits_like_any_transaction(sqlite_store: Store) -> None:
    begun = sqlite_store.transaction_now()
    assert begun is not None
    cm, tx = begun
    tx.state_put("agent", "r-1", b"one", 1)
    cm.__exit__(None, None, None)
    with sqlite_store.transaction() as again:
        assert again.state_get("agent", "r-1") == b"one"
        # Beginning without waiting left the usual wait for other writers in place.
        assert again.execute("PRAGMA busy_timeout") == [(5000,)]


def test_sqlite_gives_none_at_once_while_this_process_holds_the_store(sqlite_store: Store) -> None:
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with sqlite_store.transaction():
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(10)
        started = time.monotonic()
        assert sqlite_store.transaction_now() is None
        assert time.monotonic() - started < NOW
    finally:
        leave.set()
        holder.join(10)
    assert sqlite_store.transaction_now() is not None


def test_sqlite_gives_none_at_once_while_another_process_writes(sqlite_store: Store) -> None:
    other = sqlite3.connect(sqlite_store.url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        assert sqlite_store.transaction_now() is None
        assert time.monotonic() - started < NOW
        other.execute("ROLLBACK")
        begun = sqlite_store.transaction_now()
        assert begun is not None
        begun[0].__exit__(None, None, None)
    finally:
        other.close()


def test_postgresql_never_begins_on_the_callers_thread(pg_store: Store) -> None:
    assert pg_store.transaction_now() is None
