"""Shared fixtures: a real nats-server per test session, PostgreSQL, temp stores.

Never the machine's NATS on 4222: every session starts its own server on a free port
with its own store directory. A test that kills or restarts the server uses
``private_server`` so the others are not disturbed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from meshforge.transport.server import EmbeddedServer

# The packaged fixtures (meshforge_server, agent_harness, ...); the session server is theirs.
pytest_plugins = ["meshforge.testing.plugin"]

PG_ADMIN_URL = os.environ.get(
    "MESHFORGE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)


@pytest.fixture(scope="session")
def nats_server(meshforge_server: EmbeddedServer) -> EmbeddedServer:
    return meshforge_server


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedServer) -> str:
    return nats_server.url


@pytest.fixture
def private_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """A server of the test's own, free to be killed and restarted."""
    with EmbeddedServer(store_dir=tmp_path / "nats") as server:
        yield server


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_url)
    yield client
    await client.close()


@pytest.fixture
async def js(nc: NATS) -> JetStreamContext:
    return nc.jetstream()


@pytest.fixture
async def clean_js(js: JetStreamContext) -> JetStreamContext:
    """JetStream with every stream deleted, for tests that provision from nothing."""
    for info in await js.streams_info():
        await js.delete_stream(info.config.name)
    return js


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for this session; a missing server is a failure."""
    import psycopg

    name = f"meshforge_test_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is required at {PG_ADMIN_URL}: {exc}", pytrace=False)
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def own_pg(pg_database: str) -> Iterator[str]:
    """A PostgreSQL database of the test's own: fixed agent names meet no other test's rows."""
    import psycopg

    base, _, _ = pg_database.rpartition("/")
    name = f"meshforge_own_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_database, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield f"{base}/{name}"
    with psycopg.connect(pg_database, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def own_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store nothing else uses: a SQLite file, or a PostgreSQL database of the test's own."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    url: str = request.getfixturevalue("own_pg")
    return url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"
