"""Fixtures for the store conformance suite: every test runs on SQLite and PostgreSQL.

PostgreSQL tests share one schema of the session database (``?schema=``); after each
test its tables are emptied and any table the test made is dropped, so tests never see
each other's rows.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from meshforge.store import Store, open_store


class ManualClock:
    """A clock the test moves by hand, for leases, retries and retention."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(scope="session")
def pg_store_schema(pg_database: str) -> str:
    """One schema for the suite; the tables are created once, emptied after each test."""
    return f"store_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def pg_schema_url(pg_database: str, pg_store_schema: str) -> Iterator[str]:
    """A PostgreSQL store URL whose tables are empty; the test's own tables are dropped after."""
    yield f"{pg_database}?schema={pg_store_schema}"
    with psycopg.connect(pg_database, autocommit=True) as conn:
        names = [
            row[0]
            for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s", (pg_store_schema,)
            )
        ]
        ours = [n for n in names if n.startswith("meshforge_") and n != "meshforge_schema_version"]
        theirs = [n for n in names if not n.startswith("meshforge_")]
        qualified = ", ".join(f'"{pg_store_schema}"."{n}"' for n in ours)
        if ours:
            conn.execute(f"TRUNCATE {qualified} RESTART IDENTITY")
        for name in theirs:
            conn.execute(f'DROP TABLE "{pg_store_schema}"."{name}" CASCADE')


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    url: str = request.getfixturevalue("pg_schema_url")
    return url


@pytest.fixture
def store(store_url: str, clock: ManualClock) -> Iterator[Store]:
    opened = open_store(store_url, clock=clock)
    yield opened
    opened.close()


@pytest.fixture
def pg_store(pg_schema_url: str, clock: ManualClock) -> Iterator[Store]:
    """PostgreSQL only: for row-locking behaviour SQLite has no counterpart of."""
    opened = open_store(pg_schema_url, clock=clock)
    yield opened
    opened.close()


@pytest.fixture
def sqlite_store(tmp_path: Path, clock: ManualClock) -> Iterator[Store]:
    """SQLite only: for file and locking behaviour PostgreSQL has no counterpart of."""
    opened = open_store(f"sqlite:///{tmp_path / 'store.db'}", clock=clock)
    yield opened
    opened.close()
