"""``WorkerHarness``: run agents in a real worker on a real server and watch what they do.

It starts ``runtime.worker.Worker`` (the code ``meshforge run`` runs) for the agents,
publishes commands with a ``Publisher``, and reads the agents' events and dead letters
back from their streams; states come from the store. Everything is bounded: a wait
that does not see what it wants fails with an ``AssertionError`` naming it.

Example::

    async with WorkerHarness([OrderAgent()], settings) as h:
        cmd = await h.send("order", "create", {"sku": "A-1", "qty": 2})
        [created] = await h.wait_events("order.created")
        assert (await h.state("order", created.payload["order_id"])).status == "created"
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import nats.js.errors

from meshforge.config import Settings
from meshforge.deadletters.admin import DeadLetters
from meshforge.deadletters.route import DeadLetter
from meshforge.envelope import Envelope, decode
from meshforge.publish.publisher import Publisher, PublishResult
from meshforge.runtime import payloads
from meshforge.runtime.agent import Agent
from meshforge.runtime.worker import Worker
from meshforge.store.base import Store
from meshforge.topology.scope import Scope
from meshforge.topology.subjects import STREAM_EVENTS, command_subject
from meshforge.transport.connection import Connection, connect
from meshforge.transport.headers import text_headers

__all__ = ["WorkerHarness"]

_POLL = 0.02


class WorkerHarness:
    """A ``Worker`` for ``agents`` plus the means to send commands and see the outcome.

    ``settings`` must name the server (``nats_url``) and the store; ``store`` (optional)
    is shared with the worker so the test can read states. ``tenant`` and ``namespace``
    (default: the settings', else ``default`` and ``test``) scope the commands this harness
    sends and the events and dead letters it reads.
    """

    def __init__(
        self,
        agents: Sequence[Agent[Any]],
        settings: Settings,
        *,
        store: Store | None = None,
        tenant: str | None = None,
        namespace: str | None = None,
        deliver_group: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.agents = {a.name: a for a in agents}
        self.settings = settings
        self.tenant = tenant or settings.tenant or "default"
        self.namespace = namespace or settings.namespace or "test"
        self.timeout = timeout
        self.worker = Worker(list(agents), settings, store=store, deliver_group=deliver_group)
        self.store = store
        self._conn: Connection | None = None
        self._publisher: Publisher | None = None
        self._run: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._conn = await connect(self.settings, name="meshforge-test")
        self._publisher = Publisher(self._conn.js, self.settings)
        self._run = asyncio.create_task(self.worker.run())
        ready = asyncio.ensure_future(self.worker.ready.wait())
        done, _ = await asyncio.wait({ready, self._run}, timeout=self.timeout,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        ready.cancel()
        if self._run in done:
            await self.__aexit__(None, None, None)
            self._run.result()  # the worker's own start error
        if not done:
            await self.__aexit__(None, None, None)
            raise AssertionError(f"worker did not become ready within {self.timeout:g}s")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.worker.stop()
        if self._run is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._run, self.settings.shutdown_timeout + 5)
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    @property
    def conn(self) -> Connection:
        """The harness's own connection (not the worker's)."""
        if self._conn is None:
            raise RuntimeError("use the harness inside 'async with'")
        return self._conn

    # ------------------------------------------------------------------ in
    async def send(
        self, agent: str, command: str, payload: Mapping[str, Any] | Any = None, **fields: Any
    ) -> Envelope:
        """Publish command ``agent.command``; ``payload`` is a dict or a typed payload (sent as
        its fields, as a publisher would); ``fields`` go to ``Envelope.new``. Returns it."""
        env = Envelope.new(f"{agent}.{command}", payloads.to_builtins(payload or {}),
                           tenant_id=self.tenant, source="test", **fields)  # fmt: skip
        await self.publish(command_subject(self.tenant, self.namespace, agent, command), env)
        return env

    async def publish(self, subject: str, env: Envelope | bytes) -> PublishResult:
        """Publish anything (a prepared envelope, raw bytes) and wait for its PubAck."""
        assert self._publisher is not None, "use the harness inside 'async with'"
        return await self._publisher.publish(subject, env)

    # ------------------------------------------------------------------ out
    async def events(self, type_: str | None = None) -> list[Envelope]:
        """Events stored so far in this harness's namespace (of ``type_``), oldest first."""
        subject = f"evt.{self.tenant}.{self.namespace}.>"
        if type_:
            agent, _, name = type_.partition(".")
            subject = f"evt.{self.tenant}.{self.namespace}.{agent}.{name or '*'}"
        found: list[Envelope] = []
        seq = 1
        while True:
            try:
                raw = await self.conn.js.get_msg(STREAM_EVENTS, seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                return found
            if raw.seq is None:
                return found
            found.append(decode(raw.data or b"", text_headers(raw.headers)))
            seq = raw.seq + 1

    async def wait_events(
        self,
        type_: str | None = None,
        count: int = 1,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> list[Envelope]:
        """Wait until at least ``count`` events (of ``type_``) are stored; returns them all."""
        return await self._wait(
            lambda: self.events(type_), count, timeout, f"{count} {type_ or 'event'}(s)"
        )

    async def dead_letters(self) -> list[DeadLetter]:
        """Dead letters of commands in this harness's namespace, oldest first."""
        assert self._publisher is not None, "use the harness inside 'async with'"
        letters = DeadLetters(self.conn.js, self._publisher)
        return await letters.list(
            limit=10_000, subject_filter=f"failed.cmd.{self.tenant}.{self.namespace}.>"
        )

    async def wait_dead_letters(
        self,
        count: int = 1,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> list[DeadLetter]:
        """Wait until at least ``count`` dead letters are stored; returns them all."""
        return await self._wait(self.dead_letters, count, timeout, f"{count} dead letter(s)")

    async def state(self, agent: str, resource: str) -> Any:
        """The stored state of ``resource`` (the agent's initial state when it has none)."""
        if self.store is None:
            raise RuntimeError("give WorkerHarness a store= to read states")
        store, impl = self.store, self.agents[agent]

        scope = Scope(self.tenant, self.namespace)  # what the worker keeps is scoped by the subject

        def read() -> bytes | None:
            with store.transaction() as tx:
                return tx.state_get(agent, resource, scope=scope)

        data = await asyncio.to_thread(read)
        return impl.initial() if data is None else impl.decode_state(data)

    async def _wait(self, fetch: Any, count: int, timeout: float | None, what: str) -> list[Any]:  # noqa: ASYNC109
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            found: list[Any] = await fetch()
            if len(found) >= count:
                return found
            if self._run is not None and self._run.done():
                self._run.result()
                raise AssertionError(f"the worker stopped while waiting for {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; have {len(found)}")
            await asyncio.sleep(_POLL)  # polling the stream with a deadline
