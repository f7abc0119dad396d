"""Opening stores: URLs, migrations, closing, and what each backend does under contention."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from meshforge.errors import ConfigError, StoreError
from meshforge.store import Store, Transaction, open_store, postgres
from polling import wait_until_sync


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("", "no store URL"),
        ("mysql://root@localhost/db", "unknown scheme"),
        ("sqlite://store.db", "three slashes"),
        ("sqlite:///", "no database path"),
        ("sqlite:///x.db?journal=off", "unknown option journal"),
        ("postgresql://u@localhost/db?schema=bad-name", "schema 'bad-name'"),
        ("postgresql://u:hunter2@localhost/db?pool_size=0", "pool_size '0'"),
        ("postgresql://u@localhost/db?nonsense=1", "nonsense"),
    ],
)
def test_bad_url_is_one_line_config_error(url: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(url)
    text = str(info.value)
    assert "\n" not in text and reason in text and "expected sqlite:///" in text
    assert url.replace("hunter2", "***") in text and "hunter2" not in text


def test_unreachable_postgresql_is_a_retriable_store_error() -> None:
    with pytest.raises(StoreError, match="cannot open PostgreSQL store") as info:
        open_store("postgresql://postgres:secret@127.0.0.1:1/nowhere?connect_timeout=2")
    assert info.value.retriable and "secret" not in str(info.value)


def test_reopen_keeps_data_and_migrates_once(store_url: str) -> None:
    for expected_epoch in (1, 2, 3):
        with open_store(store_url) as store:
            with store.transaction() as tx:
                assert tx.node_epoch_bump("site", "node") == expected_epoch
                versions = tx.execute("SELECT version FROM meshforge_schema_version")
            assert versions == [(1,), (2,), (3,), (4,), (5,)]
            assert store.url == store_url
            assert store.dialect == store_url.split(":", 1)[0]


def test_closed_store_refuses_work(store: Store) -> None:
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed") as info, store.transaction():
        pass
    assert info.value.kind == "closed"
    with pytest.raises(StoreError, match="closed"):
        store.outbox_depth()


def test_sqlite_relative_path_creates_parent_dirs_in_wal_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_store("sqlite:///.meshforge/deep/store.db?busy_timeout=200")
    try:
        with store.transaction() as tx:
            assert tx.execute("PRAGMA journal_mode") == [("wal",)]
            assert tx.execute("PRAGMA busy_timeout") == [(200,)]
    finally:
        store.close()
    assert (tmp_path / ".meshforge" / "deep" / "store.db").is_file()


def test_sqlite_checkpoints_the_wal_in_a_thread_of_its_own(tmp_path: Path) -> None:
    """Commits far below the WAL's own checkpoint threshold still reach the database file:
    a thread copies them there, so no commit stops for a checkpoint."""
    path = tmp_path / "store.db"
    store = open_store(f"sqlite:///{path}")

    def checkpoint_threads() -> int:
        return sum(t.name == "meshforge-sqlite-checkpoint" for t in threading.enumerate())

    try:
        before = path.stat().st_size
        for i in range(100):  # about 100 pages of states: a few hundred WAL frames
            store.run(lambda tx, i=i: tx.state_put("a", f"r{i}", b"x" * 3000, 1))
        wait_until_sync(lambda: path.stat().st_size >= before + 100 * 3000, timeout=10,
                        what="the states copied into the database file")  # fmt: skip
        assert checkpoint_threads() == 1
    finally:
        store.close()
    assert checkpoint_threads() == 0


def test_sqlite_in_memory_store_works_across_threads() -> None:
    store = open_store("sqlite:///:memory:")
    try:
        worker = threading.Thread(target=lambda: store.run(lambda tx: tx.node_epoch_bump("s", "n")))
        worker.start()
        worker.join()
        with store.transaction() as tx:
            assert tx.node_epoch("s", "n") == 1
    finally:
        store.close()


def test_sqlite_transaction_left_open_makes_a_retriable_busy_error(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}?busy_timeout=100")
    try:
        with (
            pytest.raises(StoreError, match=r"waited 0\.1s for another transaction") as info,
            store.transaction(),
        ):
            store.outbox_depth()
        assert info.value.kind == "busy" and info.value.retriable
        assert store.outbox_depth() == 0
    finally:
        store.close()


def test_transaction_may_enter_and_leave_on_different_threads(store: Store) -> None:
    """As asyncio.to_thread does: enter, work and exit each on a thread of its own."""
    cm = store.transaction()
    box: dict[str, Transaction] = {}

    def step(action: Callable[[], object]) -> None:
        thread = threading.Thread(target=action)
        thread.start()
        thread.join()

    step(lambda: box.update(tx=cm.__enter__()))
    step(lambda: box["tx"].state_put("a", "r", b"v", 1))
    step(lambda: cm.__exit__(None, None, None))
    with store.transaction() as tx:
        assert tx.state_get("a", "r") == b"v"


def test_sqlite_writer_in_another_process_makes_a_retriable_busy_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}?busy_timeout=50"
    first, second = open_store(url), open_store(url)
    try:
        with first.transaction() as tx:
            tx.node_epoch_bump("s", "n")
            with pytest.raises(StoreError) as info, second.transaction():
                pass
        assert info.value.kind == "busy" and info.value.retriable
        assert second.run(lambda tx: tx.node_epoch_bump("s", "n")) == 2
    finally:
        first.close()
        second.close()


def test_sqlite_store_opens_while_another_process_is_still_creating_it(tmp_path: Path) -> None:
    # Two workers starting at once on a fresh file: the switch to WAL does not wait for a
    # writer (busy_timeout is not consulted), so the second open must wait by itself.
    path = tmp_path / "fresh.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("CREATE TABLE t (x)")
    other.execute("BEGIN IMMEDIATE")  # still in rollback-journal mode, write lock held
    other.execute("INSERT INTO t VALUES (1)")
    released = threading.Timer(0.3, other.execute, ("COMMIT",))
    opened: list[Store] = []
    try:
        released.start()
        opened.append(open_store(f"sqlite:///{path}?busy_timeout=5000"))
        with opened[0].transaction() as tx:
            assert tx.execute("SELECT x FROM t") == [(1,)]
    finally:
        released.join()
        for store in opened:
            store.close()
        other.close()


def test_postgresql_deadlock_is_a_retriable_conflict(pg_store: Store) -> None:
    both_locked = threading.Barrier(2, timeout=10)
    outcomes: list[str] = []

    def worker(mine: str, theirs: str) -> None:
        def work(tx: Transaction) -> None:
            tx.execute("SET LOCAL deadlock_timeout = '50ms'")
            tx.state_get("a", mine)
            both_locked.wait()
            tx.state_get("a", theirs)

        try:
            with pg_store.transaction() as tx:
                work(tx)
            outcomes.append("committed")
        except StoreError as exc:
            outcomes.append(f"{exc.kind} retriable={exc.retriable}")

    threads = [
        threading.Thread(target=worker, args=("r1", "r2")),
        threading.Thread(target=worker, args=("r2", "r1")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["committed", "conflict retriable=True"]


def _kill_backend(admin_url: str, store: Store) -> None:
    """Terminate the server process behind the store's (one) pooled connection."""
    with store.transaction() as tx:
        ((pid,),) = tx.execute("SELECT pg_backend_pid()")
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


@pytest.mark.postgres
def test_postgresql_checks_a_pooled_connection_not_used_lately(
    pg_schema_url: str, pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres, "_CHECK_AFTER", 0.0)
    store = open_store(pg_schema_url.replace("?", "?pool_size=1&"))
    try:
        _kill_backend(pg_database, store)
        with store.transaction() as tx:  # the check found it dead: a new connection
            assert tx.execute("SELECT 1") == [(1,)]
    finally:
        store.close()


@pytest.mark.postgres
def test_postgresql_connection_lost_since_its_last_commit_fails_one_transaction_retriably(
    pg_schema_url: str, pg_database: str
) -> None:
    # Committed just now: handed out unchecked (no extra round trip), so a server that
    # went away meanwhile fails one transaction, retriably; the pool drops the connection.
    store = open_store(pg_schema_url.replace("?", "?pool_size=1&"))
    try:
        _kill_backend(pg_database, store)
        with pytest.raises(StoreError) as info, store.transaction() as tx:
            tx.execute("SELECT 1")
        assert info.value.retriable, info.value
        with store.transaction() as tx:
            assert tx.execute("SELECT 1") == [(1,)]
    finally:
        store.close()
