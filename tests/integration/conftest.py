"""Fixtures shared by the integration tests of the consumer, the inbox and their kin."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from consumer_support import connection, provision_all, settings
from nats.js import JetStreamContext

from meshforge.transport.connection import Connection


@pytest.fixture
async def conn(nats_url: str, js: JetStreamContext) -> AsyncIterator[Connection]:
    """A MeshForge connection to the session server, with the five streams provisioned."""
    await provision_all(js, settings())
    async with connection(nats_url) as c:
        yield c
