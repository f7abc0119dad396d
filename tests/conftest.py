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
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from meshforge.transport.server import EmbeddedServer

# The packaged fixtures (meshforge_server, agent_harness, ...); the session server is theirs.
pytest_plugins = ["meshforge.testing.plugin"]

# How `make test` spreads the suite over its xdist workers (``--dist loadgroup``, with the
# groups below): a file stays on one worker (its module fixtures are made once), but the
# files of SPREAD send each test to whichever worker is free, and the tests of the
# in-process SparkSession share one worker (one JVM, not one per worker). Groups start
# longest first, so no worker starts a long one when the others are nearly done.
SPREAD = (
    "tests/chaos/",
    "tests/docs/test_docs_examples.py",
    "tests/integration/test_outages.py",
    "tests/integration/test_handover_order.py",
    "tests/integration/test_fleet_jobs.py",
    "tests/integration/test_fleet_sites.py",
    "tests/integration/test_partitions.py",
    "tests/integration/test_partition_fencing.py",
    "tests/integration/test_order_holds.py",
    "tests/integration/test_permissions.py",
    "tests/integration/test_fuzz_hostile.py",
    "tests/integration/test_cluster.py",
)
#: A Spark test long enough to run beside the others on a worker of its own: it starts JVMs
#: of its own (a standalone cluster, spark-submit) and no SparkSession in the worker, so
#: the shared session's worker would otherwise run it after the others.
OWN_SPARK = ("tests/spark/test_standalone.py",)
LONGEST_FIRST = (
    "tests/spark/test_standalone.py",
    "spark",
    "tests/chaos/test_order_checker",
    "tests/integration/test_demo_agents.py",
    "tests/chaos/",
    "tests/integration/test_outages.py",
    "tests/docs/",
    "tests/integration/test_handover_order.py",
    "tests/browser/",
)


def group_of(nodeid: str) -> str:
    """The scheduling group of a test: its file, its own id (SPREAD), or ``spark``."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/spark/") and not path.startswith(OWN_SPARK):
        return "spark"
    return nodeid if path.startswith(SPREAD) else path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        group = group_of(item.nodeid)
        return next(
            (i for i, p in enumerate(LONGEST_FIRST) if group.startswith(p)), len(LONGEST_FIRST)
        )

    items.sort(key=rank)  # stable: a file's tests keep their order


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: the groups of ``group_of``, in the order collected."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False  # keep LONGEST_FIRST, not the largest group first
    return Groups(config, log)


# The tests' JVMs (the SparkSession, spark-submit, a standalone master and worker) compile
# with the JIT's first tier only: a test's Spark work is short, and the second tier's
# compiling costs more CPU than it saves (a session's start and a few small jobs: 27 s of
# CPU, 16 s so). Set before any JVM starts; child processes inherit it.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
os.environ.setdefault("SPARK_SUBMIT_OPTS", TEST_JVM_OPTIONS)
os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", TEST_JVM_OPTIONS)

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
