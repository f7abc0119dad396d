"""The in-process AgentHarness runs commands as the engine would: outputs, state, dead letters."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec

from meshforge.demo import InventoryAgent, OrderAgent
from meshforge.envelope import Envelope
from meshforge.runtime.agent import Agent, Event, command
from meshforge.testing import AgentHarness

Harness = Callable[..., AgentHarness[Any]]


def test_events_state_and_sends_of_one_command(agent_harness: Harness) -> None:
    h = agent_harness(OrderAgent())
    sent = h.send("create", {"order_id": "o-1", "sku": "A-1", "qty": 2})
    assert sent.event_types == ["order.created"]
    assert sent.event("created").payload == {"order_id": "o-1", "sku": "A-1", "qty": 2}
    [(subject, reserve)] = sent.commands
    assert subject == "cmd.default.test.inventory.reserve"
    assert reserve.causation_id == sent.command.id
    assert h.state("o-1").status == "created"
    assert sent.state is not None and sent.state.qty == 2
    assert h.send("get", {"order_id": "o-1"}).event("found").payload["order"]["sku"] == "A-1"


def test_a_repeated_key_gets_the_same_outputs_without_running_again(agent_harness: Harness) -> None:
    h = agent_harness(OrderAgent())
    first = h.send("create", {"sku": "A-1", "qty": 1}, idempotency_key="req-1")
    again = h.send("create", {"sku": "A-1", "qty": 1}, idempotency_key="req-1")
    assert again.duplicate and again.dead_letter is None
    assert [e.id for e in again.events] == [e.id for e in first.events]
    assert len(h.events) == 1


def test_bad_payloads_and_unknown_commands_are_dead_letters(agent_harness: Harness) -> None:
    h = agent_harness(InventoryAgent())
    bad = h.send("create", {"sku": "A-1", "qty": 0})
    assert bad.dead_letter is not None and bad.dead_letter.reason == "invalid_payload"
    assert "Expected `int` >= 1 - at `$.qty`" in bad.dead_letter.error
    assert bad.events == [] and not h.state("A-1").exists
    unknown = h.send("nope", {"sku": "A-1"})
    assert (
        unknown.dead_letter is not None
        and "unknown command 'inventory.nope'" in unknown.dead_letter.error
    )
    assert [d.subject for d in h.dead_letters] == [
        "failed.cmd.default.test.inventory.create", "failed.cmd.default.test.inventory.nope",
    ]  # fmt: skip


class _Count(msgspec.Struct):
    n: int = 0


class _Flaky(Agent[_Count]):
    """Fails with a transient error the first ``fail`` times, then counts."""

    name = "flaky"

    def __init__(self, fail: int) -> None:
        super().__init__()
        self.fail = fail
        self.calls = 0

    @command("bump")
    def bump(self, cmd: Envelope, state: _Count) -> list[Event]:
        self.calls += 1
        if self.calls <= self.fail:
            raise ConnectionError("database away")
        return [Event("bumped", {"n": state.n + 1})]

    def apply(self, state: _Count, event: Event) -> _Count:
        return _Count(n=event.payload["n"])


def test_transient_failures_are_retried_then_dead_lettered(agent_harness: Harness) -> None:
    recovers = agent_harness(_Flaky(fail=2), max_deliver=3)
    sent = recovers.send("bump")
    assert sent.deliveries == 3 and sent.event_types == ["flaky.bumped"]
    assert recovers.state("_").n == 1
    never = agent_harness(_Flaky(fail=10), max_deliver=3)
    lost = never.send("bump")
    assert lost.dead_letter is not None and lost.dead_letter.reason == "max_deliveries"
    assert lost.dead_letter.deliveries == 3 and "database away" in lost.dead_letter.error


async def test_works_from_async_tests_too(agent_harness: Harness) -> None:
    h = agent_harness(OrderAgent())
    assert h.send("create", {"sku": "A-1", "qty": 1}).event_types == ["order.created"]
    assert (await h.asend("get", {"order_id": "missing"})).event_types == ["order.not_found"]


class _Slow(Agent[_Count]):
    """An async handler that never ends unless its timeout ends it; or one huge event."""

    name = "slow"

    @command("wait", timeout=0.2)
    async def wait(self, cmd: Envelope, state: _Count) -> list[Event]:
        await asyncio.Event().wait()
        return []

    @command("huge")
    def huge(self, cmd: Envelope, state: _Count) -> list[Event]:
        return [Event("big", {"pad": "x" * 2_000_000})]


def test_the_harness_applies_the_handler_timeout_as_a_worker_does(agent_harness: Harness) -> None:
    sent = agent_harness(_Slow(), max_deliver=2).send("wait")
    assert sent.dead_letter is not None and sent.dead_letter.reason == "max_deliveries"
    assert sent.dead_letter.deliveries == 2
    assert "HandlerTimeout: handler slow.wait timed out after 0.2s" in sent.dead_letter.error


def test_an_output_the_server_would_refuse_is_a_dead_letter_in_the_harness_too(
    agent_harness: Harness,
) -> None:
    h = agent_harness(_Slow())
    sent = h.send("huge")
    assert sent.dead_letter is not None and sent.dead_letter.reason == "unrecoverable"
    assert "over the server's max_payload of 1048576 bytes" in sent.dead_letter.error
    assert sent.events == [] and h.events == []
