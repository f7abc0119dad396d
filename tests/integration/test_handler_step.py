"""One handler step: the same commands through ``AgentHarness`` and through a real worker give
the same outputs (ids, subjects, payloads), the same states and the same decisions.

The table covers what the step decides: a dict payload, a typed one, a typed one that does
not fit (``invalid_payload`` naming the field, in the worker as in the harness), a missing
resource key, a handler raising ``Unrecoverable``, a transient error (retried to the
limit), a handler past its timeout, and an output larger than the server takes.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from test_engine_support import (
    SCOPE,
    Tap,
    consumer_idle,
    dead_letters_of,
    events_of,
    open_conn,
    open_store_async,
    running,
    settings_for,
    wait_until,
)

from meshforge.envelope import Envelope, decode
from meshforge.errors import Unrecoverable
from meshforge.publish.publisher import Publisher
from meshforge.runtime import Agent, Command, Event, Output, Send, command
from meshforge.runtime.replay import canonical
from meshforge.testing import AgentHarness

MAX_DELIVER = 3


class Put(msgspec.Struct):
    item: str
    n: int
    label: str = ""


class Tally(msgspec.Struct):
    total: int = 0
    labels: list[str] = msgspec.field(default_factory=list)


def table_agent() -> Agent[Tally]:
    """A fresh agent with a unique name (tests on the shared server never meet)."""
    agent_name = f"step{uuid.uuid4().hex[:8]}"

    class TableAgent(Agent[Tally]):
        name = agent_name
        events = {"typed": Put}

        @command("put", key="item")
        def put(self, cmd: Envelope, state: Tally) -> list[Output]:
            n = int(cmd.payload["n"])
            return [
                Event("put", {"item": cmd.payload["item"], "n": n}),
                Send(agent_name + "x", "notify", {"item": cmd.payload["item"]}),
            ]

        @command("typed", key="item")
        def typed(self, cmd: Command[Put], state: Tally) -> list[Output]:
            return [Event("typed", Put(cmd.payload.item, cmd.payload.n * 10, "typed"))]

        @command("fail", key="item")
        def fail(self, cmd: Envelope, state: Tally) -> list[Output]:
            state.labels.append("changed in place")  # must not survive the failure
            mode = cmd.payload["mode"]
            if mode == "unrecoverable":
                raise Unrecoverable("this order can never ship")
            if mode == "huge":
                return [Event("put", {"item": "h", "n": 1, "pad": "x" * cmd.payload["bytes"]})]
            raise RuntimeError("backend away")

        @command("slow", key="item", timeout=0.3)
        async def slow(self, cmd: Envelope, state: Tally) -> list[Output]:
            await asyncio.Event().wait()  # never ends: the timeout does
            return []

        def apply(self, state: Tally, event: Event) -> Tally:
            if event.name == "typed":
                assert isinstance(event.payload, Put)
                return Tally(state.total + event.payload.n, [*state.labels, event.payload.label])
            return Tally(state.total + event.payload["n"], state.labels)

    return TableAgent()


def cases(max_payload: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(case, command, payload): the table both runs take, in this order."""
    return [
        ("dict payload", "put", {"item": "a", "n": 1}),
        ("typed payload", "typed", {"item": "a", "n": 2}),
        ("typed payload that does not fit", "typed", {"item": "a", "n": "two"}),
        ("typed payload missing a field", "typed", {"item": "a"}),
        ("missing key", "put", {"n": 1}),
        ("unknown command", "nope", {"item": "a"}),
        ("unrecoverable", "fail", {"item": "a", "mode": "unrecoverable"}),
        ("transient error", "fail", {"item": "a", "mode": "transient"}),
        ("handler timeout", "slow", {"item": "a"}),
        ("oversize output", "fail", {"item": "a", "mode": "huge", "bytes": max_payload}),
        ("after the failures", "put", {"item": "a", "n": 4}),
    ]


@dataclass(frozen=True)
class Result:
    """What became of one command: its outputs, or its dead letter."""

    outputs: tuple[tuple[str, str, str, str], ...]  # (subject, id, type, payload JSON)
    dead_letter: tuple[str, str, int] | None  # (reason, error, deliveries)


def output(subject: str, env: Envelope) -> tuple[str, str, str, str]:
    return subject, env.id, env.type, msgspec.json.encode(env.payload).decode()


def through_harness(
    agent: Agent[Tally], envs: list[Envelope], limits: Any
) -> tuple[list[Result], bytes]:
    harness = AgentHarness(agent, max_deliver=MAX_DELIVER, limits=limits)
    results = []
    for env in envs:
        sent = harness.send(env.type.split(".")[1], envelope=env)
        letter = sent.dead_letter
        results.append(Result(
            tuple(output(s, e) for s, e in sent.messages),
            (letter.reason, letter.error, letter.deliveries) if letter else None,
        ))  # fmt: skip
    return results, agent.encode_state(harness.state("a"))


async def test_harness_and_worker_take_the_same_decisions(nats_url: str, sqlite_url: str) -> None:
    agent = table_agent()
    settings = settings_for(nats_url, sqlite_url, max_deliver=MAX_DELIVER)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    publisher = Publisher(conn.js)
    limits = publisher.limits()
    table = cases(limits.max_payload)
    envs = [
        Envelope.new(f"{agent.name}.{cmd}", payload, source="test") for _, cmd, payload in table
    ]
    # The notify commands are on a work-queue stream: seen on the wire as they are sent.
    tap = await Tap.on(conn.nc, f"cmd.*.*.{agent.name}x.>")
    try:
        async with running([agent], settings, store=store):
            for env, (_, cmd, _) in zip(envs, table, strict=True):
                # One at a time: the states (and so the outputs) then follow the table's order.
                await publisher.publish(f"cmd.default.test.{agent.name}.{cmd}", env)
                await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
            events = await events_of(conn, agent.name)
            sends = tap.msgs
            letters = await dead_letters_of(conn, agent.name)
        with store.transaction() as tx:
            worker_state = tx.state_get(agent.name, "a", scope=SCOPE)
    finally:
        await conn.close()
        store.close()

    by_cause: dict[str, set[tuple[str, str, str, str]]] = {}
    wire = [(m.subject, m.envelope()) for m in events]
    wire += [(m.subject, decode(m.data, dict(m.headers or {}))) for m in sends]
    for subject, env in wire:
        assert env is not None and env.causation_id is not None
        by_cause.setdefault(env.causation_id, set()).add(output(subject, env))
    dead = {}
    for m in letters:
        env = m.envelope()
        assert env is not None
        dead[env.id] = (m.headers["Dlq-Reason"], m.headers["Dlq-Error"],
                        int(m.headers["Dlq-Deliveries"]))  # fmt: skip
    in_worker = [
        Result(
            tuple(sorted(by_cause.get(env.id, []), key=lambda o: o[1])),
            dead.get(env.id),
        )
        for env in envs
    ]

    in_harness, harness_state = through_harness(table_agent_like(agent), envs, limits)
    in_harness = [
        Result(tuple(sorted(r.outputs, key=lambda o: o[1])), r.dead_letter) for r in in_harness
    ]
    for (case, _, _), harness, worker in zip(table, in_harness, in_worker, strict=True):
        assert harness == worker, case
    assert worker_state is not None and canonical(worker_state) == canonical(harness_state)

    # What the table is about, spelled out (the comparison alone would pass if both were wrong).
    decisions = {case: r.dead_letter for (case, _, _), r in zip(table, in_worker, strict=True)}
    assert decisions["dict payload"] is None and decisions["typed payload"] is None
    reason, error, deliveries = decisions["typed payload that does not fit"] or ("", "", 0)
    assert (reason, deliveries) == ("invalid_payload", 1)
    assert "Expected `int`, got `str` - at `$.n`" in error
    reason, error, deliveries = decisions["typed payload missing a field"] or ("", "", 0)
    assert reason == "invalid_payload" and "missing required field `n`" in error
    assert (decisions["missing key"] or ("",))[0] == "unrecoverable"
    assert "unknown command" in (decisions["unknown command"] or ("", ""))[1]
    assert decisions["unrecoverable"] == (
        "unrecoverable", "Unrecoverable: this order can never ship", 1,
    )  # fmt: skip
    assert decisions["transient error"] == (
        "max_deliveries", "RuntimeError: backend away", MAX_DELIVER,
    )  # fmt: skip
    reason, error, deliveries = decisions["handler timeout"] or ("", "", 0)
    assert (reason, deliveries) == (
        "max_deliveries",
        MAX_DELIVER,
    ) and "timed out after 0.3s" in error
    reason, error, deliveries = decisions["oversize output"] or ("", "", 0)
    assert (reason, deliveries) == ("unrecoverable", 1) and "output 0" in error
    assert msgspec.json.decode(worker_state) == {"total": 25, "labels": ["typed"]}


def table_agent_like(agent: Agent[Tally]) -> Agent[Tally]:
    """Another instance of the same agent class (same name, same declarations)."""
    return type(agent)()
