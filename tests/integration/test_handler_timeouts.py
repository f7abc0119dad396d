"""A long ``async def`` handler is kept alive like a plain one; its limit is a setting
(``handler_timeout``, an agent's ``timeout``, ``@command(timeout=)``) that says which
one fired and how to raise it (issue 24)."""

from __future__ import annotations

import asyncio
import uuid
from typing import ClassVar

import msgspec
import pytest
from test_engine_support import (
    consumer_idle,
    dead_letters_of,
    events_of,
    open_conn,
    running,
    send,
    settings_for,
    wait_until,
)

from meshforge.config import load_settings
from meshforge.envelope import Envelope
from meshforge.errors import ConfigError
from meshforge.runtime import Agent, Event, Output, command


class Calls(msgspec.Struct):
    n: int = 0


def sleepy_agent(
    agent_timeout: float | None = None, command_timeout: float | None = None
) -> Agent[Calls]:
    """``nap {"id", "seconds"}`` sleeps (awaiting) then emits ``napped``; ``started``
    counts the handler's starts per command id."""

    class Sleepy(Agent[Calls]):
        name = f"nap{uuid.uuid4().hex[:8]}"
        timeout = agent_timeout
        started: ClassVar[dict[str, int]] = {}

        @command("nap", key="id", **({"timeout": command_timeout} if command_timeout else {}))
        async def nap(self, cmd: Envelope, state: Calls) -> list[Output]:
            self.started[cmd.id] = self.started.get(cmd.id, 0) + 1
            await asyncio.sleep(float(cmd.payload["seconds"]))
            return [Event("napped", {"id": cmd.payload["id"]})]

        def apply(self, state: Calls, event: Event) -> Calls:
            return Calls(state.n + 1)

    return Sleepy()


async def test_async_handler_longer_than_half_the_ack_wait_is_kept_alive_and_applied_once(
    nats_url: str, sqlite_url: str
) -> None:
    # The case scaled down: ack wait 2 s, each handler sleeps 3 s (it was cut at 1 s).
    agent = sleepy_agent()
    settings = settings_for(nats_url, sqlite_url, ack_wait=2.0, backoff=(1.0, 2.0), max_deliver=3)
    conn = await open_conn(settings)
    try:
        async with running([agent], settings):
            cmds = [
                await send(conn, agent.name, "nap", {"id": f"r{i}", "seconds": 3}) for i in range(5)
            ]
            await wait_until(lambda: consumer_idle(conn, agent.name), within=60)
        letters = await dead_letters_of(conn, agent.name)
        assert letters == [], [m.headers.get("Dlq-Error") for m in letters]
        causes = sorted(m.envelope().causation_id or "" for m in await events_of(conn, agent.name))
        assert causes == sorted(c.id for c in cmds)
        assert all(agent.started[c.id] == 1 for c in cmds), agent.started  # type: ignore[attr-defined]
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("agent_timeout", "command_timeout", "settings_timeout", "named"),
    [
        (None, 0.3, 300.0, "@command('nap', timeout=...)"),
        (0.3, None, 300.0, "Sleepy.timeout"),
        (None, None, 0.3, "handler_timeout (MESHFORGE_HANDLER_TIMEOUT)"),
    ],
)
async def test_a_handler_cut_off_by_its_timeout_is_transient_and_names_the_limit(
    nats_url: str, sqlite_url: str, agent_timeout: float | None, command_timeout: float | None,
    settings_timeout: float, named: str,
) -> None:  # fmt: skip
    agent = sleepy_agent(agent_timeout, command_timeout)
    settings = settings_for(nats_url, sqlite_url, max_deliver=2, handler_timeout=settings_timeout)
    conn = await open_conn(settings)
    try:
        async with running([agent], settings):
            slow = await send(conn, agent.name, "nap", {"id": "a", "seconds": 5})
            await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
        [letter] = await dead_letters_of(conn, agent.name)
    finally:
        await conn.close()
    assert letter.headers["Dlq-Reason"] == "max_deliveries"  # retried first: transient
    assert agent.started[slow.id] == 2  # type: ignore[attr-defined]
    error = letter.headers["Dlq-Error"]
    assert error.startswith("HandlerTimeout: handler ") and "timed out after 0.3s" in error, error
    assert named in error, error


def test_handler_timeout_comes_from_the_environment_and_must_be_positive() -> None:
    assert load_settings({}, env={}).handler_timeout == 300.0
    assert load_settings({}, env={"MESHFORGE_HANDLER_TIMEOUT": "2m"}).handler_timeout == 120.0
    with pytest.raises(ConfigError, match="MESHFORGE_HANDLER_TIMEOUT"):
        load_settings({}, env={"MESHFORGE_HANDLER_TIMEOUT": "0"})
    with pytest.raises(ConfigError, match="timeout must be positive"):
        command("x", timeout=0)
