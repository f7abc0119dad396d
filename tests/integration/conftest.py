"""Fixtures shared by the integration tests of the consumer, the inbox and their kin."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from consumer_support import connection, provision_all, settings
from inbox_support import create_credits
from nats.js import JetStreamContext

from meshforge.store import Store, open_store
from meshforge.transport.connection import Connection


@pytest.fixture
async def conn(nats_url: str, js: JetStreamContext) -> AsyncIterator[Connection]:
    """A MeshForge connection to the session server, with the five streams provisioned."""
    await provision_all(js, settings())
    async with connection(nats_url) as c:
        yield c


@pytest.fixture(params=["sqlite", "postgresql"])
def inbox_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A store on SQLite or PostgreSQL (a schema of its own) with the inbox tests' table."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'inbox.db'}"
    else:
        base: str = request.getfixturevalue("pg_database")
        url = f"{base}?schema=inbox_{uuid.uuid4().hex[:10]}"
    opened = open_store(url)
    create_credits(opened)
    yield opened
    opened.close()
