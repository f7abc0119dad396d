"""The MeshForge pytest plugin (entry point ``pytest11``): a real server and agents under test.

Fixtures (names prefixed so they never clash with a project's own):

- ``meshforge_server`` (session): an embedded nats-server with JetStream, on a free port.
- ``meshforge_url`` (session): its URL.
- ``meshforge_store_url`` / ``meshforge_store``: a fresh SQLite store per test.
- ``meshforge_settings``: ``Settings`` for that server and store, with short retry delays.
- ``meshforge_connection`` (async): a ``Connection`` with the CONTRACT streams created
  afresh, so every test starts with empty streams and no consumers.
- ``agent_harness``: ``agent_harness(MyAgent())`` gives an in-process ``AgentHarness``.
- ``agent_worker``: ``async with agent_worker(MyAgent()) as h:`` runs a real worker on
  the session server (streams reset first) and gives a ``WorkerHarness``.

The async fixtures need ``pytest-asyncio``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meshforge.config import Settings, load_settings
from meshforge.runtime.agent import Agent
from meshforge.store import open_store
from meshforge.store.base import Store
from meshforge.testing.harness import AgentHarness
from meshforge.testing.live import WorkerHarness
from meshforge.transport.server import EmbeddedServer

__all__ = [
    "agent_harness",
    "agent_worker",
    "meshforge_server",
    "meshforge_settings",
    "meshforge_store",
    "meshforge_store_url",
    "meshforge_url",
    "reset_streams",
]

# Short delays: a failing command reaches its dead letter in under two seconds. The first
# entry is a delivery's first ack wait: a second, so a loaded machine does not redeliver.
TEST_SETTINGS: dict[str, object] = {
    "backoff": "1s,100ms,200ms,400ms",
    "ack_wait": "5s",
    "shutdown_timeout": "5s",
    "provision": True,
    "connect_attempts": 3,
}


@pytest.fixture(scope="session")
def meshforge_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """One embedded nats-server (JetStream on, own port and directory) for the session."""
    with EmbeddedServer(store_dir=tmp_path_factory.mktemp("meshforge-nats")) as server:
        yield server


@pytest.fixture(scope="session")
def meshforge_url(meshforge_server: EmbeddedServer) -> str:
    """``nats://127.0.0.1:<port>`` of the session's server."""
    return meshforge_server.url


@pytest.fixture
def meshforge_store_url(tmp_path: Path) -> str:
    """A SQLite store URL in the test's own directory."""
    return f"sqlite:///{tmp_path / 'meshforge-store.db'}"


@pytest.fixture
def meshforge_store(meshforge_store_url: str) -> Iterator[Store]:
    """The opened store of ``meshforge_store_url``, closed after the test."""
    store = open_store(meshforge_store_url)
    yield store
    store.close()


@pytest.fixture
def meshforge_settings(meshforge_url: str, meshforge_store_url: str) -> Settings:
    """Settings for the session server and the test's store (environment ignored)."""
    return load_settings(
        {**TEST_SETTINGS, "nats_url": meshforge_url, "store_url": meshforge_store_url}, env={}
    )


async def reset_streams(settings: Settings) -> None:
    """Delete every stream of the server, then create the CONTRACT streams empty."""
    from meshforge.topology.provision import ensure
    from meshforge.topology.specs import default_streams
    from meshforge.transport.connection import connect

    async with await connect(settings, name="meshforge-test-reset") as conn:
        for info in await conn.js.streams_info():
            if info.config.name:
                await conn.js.delete_stream(info.config.name)
        await ensure(conn.js, default_streams(settings), [])


@pytest.fixture
def agent_harness() -> Callable[..., AgentHarness[Any]]:
    """``agent_harness(MyAgent(), **options)``: an in-process ``AgentHarness`` (no server)."""
    return AgentHarness


class _Workers:
    """What ``agent_worker`` returns: call it with agents for a ``WorkerHarness``."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store

    def __call__(self, *agents: Agent[Any], **options: Any) -> _Started:
        return _Started(self, agents, options)


class _Started:
    """Resets the streams, then enters the ``WorkerHarness``."""

    def __init__(
        self, workers: _Workers, agents: tuple[Agent[Any], ...], options: dict[str, Any]
    ) -> None:
        self._harness = WorkerHarness(
            list(agents), workers.settings, store=workers.store, **options
        )
        self._settings = workers.settings

    async def __aenter__(self) -> WorkerHarness:
        await reset_streams(self._settings)
        return await self._harness.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        await self._harness.__aexit__(*exc)


@pytest.fixture
def agent_worker(meshforge_settings: Settings, meshforge_store: Store) -> _Workers:
    """``async with agent_worker(MyAgent()) as h:`` a real worker on the session server."""
    return _Workers(meshforge_settings, meshforge_store)


try:
    import pytest_asyncio
except ImportError:  # without it only the synchronous fixtures are offered
    pass
else:
    from meshforge.transport.connection import Connection

    @pytest_asyncio.fixture
    async def meshforge_connection(meshforge_settings: Settings) -> AsyncIterator[Connection]:
        """A connection to the session server; the CONTRACT streams exist and are empty."""
        from meshforge.transport.connection import connect

        await reset_streams(meshforge_settings)
        conn = await connect(meshforge_settings, name="meshforge-test")
        try:
            yield conn
        finally:
            await asyncio.shield(conn.close())
