"""Redeliveries come after the configured backoff, not about twice it (issue 24): the
server adds ``BackOff[n-1] - AckWait`` to a delayed nak, which the acker takes off."""

from __future__ import annotations

import itertools
import time
import uuid
from typing import ClassVar

import msgspec
from test_engine_support import (
    consumer_idle,
    dead_letters_of,
    open_conn,
    running,
    send,
    settings_for,
    wait_until,
)

from meshforge.consume.ack import Acker
from meshforge.envelope import Envelope
from meshforge.ops.observability import Metrics
from meshforge.runtime import Agent, Event, Output, command

BACKOFF = (0.5, 1.5, 3.0)


class Nothing(msgspec.Struct):
    n: int = 0


def failing_agent() -> Agent[Nothing]:
    """``fail`` always raises a transient error; ``at`` keeps when each delivery ran."""

    class Failing(Agent[Nothing]):
        name = f"bo{uuid.uuid4().hex[:8]}"
        at: ClassVar[list[float]] = []

        @command("fail", key="id")
        def fail(self, cmd: Envelope, state: Nothing) -> list[Output]:
            self.at.append(time.monotonic())
            raise RuntimeError("the backend is away")

        def apply(self, state: Nothing, event: Event) -> Nothing:
            return state

    return Failing()


async def test_redeliveries_come_after_the_configured_backoff(
    nats_url: str, sqlite_url: str
) -> None:
    agent = failing_agent()
    settings = settings_for(nats_url, sqlite_url, ack_wait=5.0, backoff=BACKOFF, max_deliver=4)
    conn = await open_conn(settings)
    try:
        async with running([agent], settings):
            await send(conn, agent.name, "fail", {"id": "a"})
            await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
        assert len(await dead_letters_of(conn, agent.name)) == 1
    finally:
        await conn.close()
    at: list[float] = agent.at  # type: ignore[attr-defined]
    gaps = [b - a for a, b in itertools.pairwise(at)]
    assert len(gaps) == len(BACKOFF), gaps
    for gap, wanted in zip(gaps, BACKOFF, strict=True):
        assert wanted - 0.05 <= gap <= wanted + 0.5, (
            f"gaps {[round(g, 2) for g in gaps]}, configured {BACKOFF}"
        )


def test_the_nak_delay_sent_takes_off_what_the_server_adds() -> None:
    acker = Acker("c", Metrics(), lambda: None, server_wait=(1.0, (1.0, 5.0, 10.0, 30.0)))  # type: ignore[arg-type,return-value]
    assert [acker.nak_delay(d, n) for n, d in enumerate((1.0, 5.0, 10.0, 30.0, 30.0), 1)] == [
        1.0
    ] * 5
    assert acker.nak_delay(0.5, 3) == 0.001  # the server cannot wait less than 9 s more here
    assert acker.nak_delay(None, 3) is None and acker.nak_delay(0.0, 3) == 0.0  # at once
    plain = Acker("c", Metrics(), lambda: None, server_wait=(30.0, ()))  # type: ignore[arg-type,return-value]
    assert plain.nak_delay(2.0, 3) == 2.0  # no BackOff: the server waits what it is told
