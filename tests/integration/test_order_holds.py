"""Per-resource order through failures: a command that is not applied for a reason that is
not final holds its resource's later commands, across fetches and restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

import msgspec
import pytest
from test_engine_support import (
    consumer_idle,
    dead_letters_of,
    events_of,
    open_conn,
    open_store_async,
    running,
    settings_for,
    wait_until,
)

import polling
from meshforge.envelope import Envelope
from meshforge.errors import Retry
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.runtime import Agent, Event, Output, command
from meshforge.runtime.holds import list_holds
from meshforge.topology.partitions import partitioned
from meshforge.topology.scope import Scope
from meshforge.topology.subjects import STREAM_COMMANDS

SCOPE = Scope("default", "test")


class Seq(msgspec.Struct):
    applied: list[int] = msgspec.field(default_factory=list)


def seq_agent(*, stay_held: bool = False) -> Agent[Seq]:
    """``add {"r", "n", "fail"?, "retry"?, "bad"?}`` appends ``n`` to resource ``r``;
    ``fail``: raise on the first that many attempts; ``retry``: return
    ``Retry(delay=retry)`` once; ``bad``: ValueError (dead-lettered at once)."""
    attempts: dict[str, int] = {}

    class Sequencer(Agent[Seq]):
        name = f"seq{uuid.uuid4().hex[:8]}"
        hold_after_dead_letter = stay_held

        @command("add", key="r")
        def add(self, cmd: Envelope, state: Seq) -> list[Output]:
            p = cmd.payload
            seen = attempts[cmd.id] = attempts.get(cmd.id, 0) + 1
            if p.get("bad"):
                raise ValueError("not a number this agent takes")
            if seen <= int(p.get("fail", 0)):
                raise RuntimeError(f"backend away (attempt {seen})")
            if "retry" in p and seen == 1:
                raise Retry("not yet", delay=float(p["retry"]))
            return [Event("added", {"r": p["r"], "n": p["n"]})]

        def apply(self, state: Seq, event: Event) -> Seq:
            return Seq([*state.applied, int(event.payload["n"])])

    agent = Sequencer()
    agent.attempts = attempts  # type: ignore[attr-defined]
    return agent


async def _send(conn: Any, agent: Agent[Seq], r: str, n: int, **extra: Any) -> Envelope:
    env = Envelope.new(f"{agent.name}.add", {"r": r, "n": n, **extra}, source="test", resource_id=r)
    await Publisher(conn.js).publish(f"cmd.default.test.{agent.name}.add", env)
    return env


def _applied(store: Any, agent: Agent[Seq], r: str) -> list[int]:
    with store.transaction() as tx:
        raw = tx.state_get(agent.name, r, scope=SCOPE)
    return [] if raw is None else msgspec.json.decode(raw, type=Seq).applied


async def _events_order(conn: Any, agent: Agent[Seq], r: str) -> list[int]:
    out = []
    for m in await events_of(conn, agent.name):
        env = m.envelope()
        assert env is not None
        if env.payload["r"] == r:
            out.append(int(env.payload["n"]))
    return out


async def _head_then(
    conn: Any, agent: Agent[Seq], r: str, head: dict[str, Any], later: range
) -> Envelope:
    """Send n=1 of ``r`` (with ``head``'s failure), wait for its first attempt, then send ``later``."""
    first = await _send(conn, agent, r, 1, **head)
    await polling.wait_until(
        lambda: agent.attempts.get(first.id, 0) >= 1,  # type: ignore[attr-defined]
        timeout=10,
        what="the first attempt",
    )
    for n in later:
        await _send(conn, agent, r, n)
    return first


@pytest.mark.parametrize("failure", [{"fail": 1}, {"retry": 2.0}], ids=["exception", "retry"])
async def test_later_commands_wait_for_one_that_failed_in_an_earlier_fetch(
    nats_url: str, sqlite_url: str, failure: dict[str, Any]
) -> None:
    """What a user saw: n=1 fails once, n=2..5 published after its first attempt were
    applied first (2,3,4,5,1). Each fetch is its own group here."""
    agent = seq_agent()
    settings = settings_for(nats_url, sqlite_url, backoff=(1.5, 1.5, 1.5), max_deliver=4)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    try:
        async with running([agent], settings, store=store):
            await _head_then(conn, agent, "a", failure, range(2, 6))
            await _send(conn, agent, "b", 1)
            await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
            assert _applied(store, agent, "a") == [1, 2, 3, 4, 5]
            assert _applied(store, agent, "b") == [1]
            assert await _events_order(conn, agent, "a") == [1, 2, 3, 4, 5]
            assert not await dead_letters_of(conn, agent.name)
    finally:
        store.close()
        await conn.close()


async def test_held_commands_do_not_burn_their_deliveries(nats_url: str, sqlite_url: str) -> None:
    """The head fails on all but its last allowed attempt: the commands held behind it are
    redelivered more often than ``max_deliver``, yet none is dead-lettered."""
    agent = seq_agent()
    settings = settings_for(nats_url, sqlite_url, backoff=(1.0, 0.3, 0.3), max_deliver=3)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    try:
        async with running([agent], settings, store=store):
            await _head_then(conn, agent, "a", {"fail": 2}, range(2, 5))
            await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
            assert _applied(store, agent, "a") == [1, 2, 3, 4]
            assert not await dead_letters_of(conn, agent.name)
    finally:
        store.close()
        await conn.close()


async def test_a_dead_lettered_head_lets_the_rest_pass(nats_url: str, sqlite_url: str) -> None:
    agent = seq_agent()
    settings = settings_for(nats_url, sqlite_url, backoff=(0.3, 0.3, 0.3), max_deliver=2)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    try:
        async with running([agent], settings, store=store):
            await _head_then(conn, agent, "a", {"fail": 99}, range(2, 5))
            await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
            assert _applied(store, agent, "a") == [2, 3, 4]
            letters = await dead_letters_of(conn, agent.name)
            assert [m.headers.get("Dlq-Reason") for m in letters] == ["max_deliveries"]
    finally:
        store.close()
        await conn.close()


async def test_the_hold_survives_a_restart(nats_url: str, sqlite_url: str) -> None:
    """The worker stops while n=1 waits for its next attempt: the next worker, which never
    saw n=1 fail, still applies n=2..4 after it."""
    agent = seq_agent()
    settings = settings_for(nats_url, sqlite_url, backoff=(3.0, 3.0, 3.0), max_deliver=4)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    try:
        async with running([agent], settings, store=store):
            await _head_then(conn, agent, "a", {"fail": 1}, range(0))
        for n in range(2, 5):
            await _send(conn, agent, "a", n)
        async with running([agent], settings, store=store):
            await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
            assert _applied(store, agent, "a") == [1, 2, 3, 4]
    finally:
        store.close()
        await conn.close()


async def test_two_partitioned_workers_keep_the_order_after_a_failure(
    nats_url: str, own_pg: str
) -> None:
    """The same as a user saw it on a partitioned subject with two workers sharing one
    PostgreSQL store."""
    agent = seq_agent()
    settings = settings_for(nats_url, own_pg, backoff=(1.5, 1.5, 1.5), max_deliver=4, partitions=2)
    conn = await open_conn(settings)
    store = await open_store_async(own_pg)
    publisher = Publisher(conn.js, settings)

    async def send(r: str, n: int, **extra: Any) -> Envelope:
        env = Envelope.new(
            f"{agent.name}.add", {"r": r, "n": n, **extra}, source="test", resource_id=r
        )
        await publisher.publish(
            partitioned(f"cmd.default.test.{agent.name}.add", env, settings), env
        )
        return env

    async def idle() -> bool:
        infos = [await conn.js.consumer_info("MESHFORGE_COMMANDS", f"{agent.name}_consumer_{s}")
                 for s in ("p0", "p1", "unpartitioned")]  # fmt: skip
        return all(i.num_pending == 0 and i.num_ack_pending == 0 for i in infos)

    try:
        async with running([agent], settings), running([agent], settings):
            firsts = [await send(r, 1, fail=1) for r in ("a", "b", "c", "d")]
            await polling.wait_until(
                lambda: all(agent.attempts.get(f.id, 0) >= 1 for f in firsts),  # type: ignore[attr-defined]
                timeout=15,
                what="the first attempts",
            )
            for n in range(2, 6):
                for r in ("a", "b", "c", "d"):
                    await send(r, n)
            await polling.wait_until(idle, timeout=40, what="every durable idle")
            for r in ("a", "b", "c", "d"):
                assert _applied(store, agent, r) == [1, 2, 3, 4, 5], r
            assert not await dead_letters_of(conn, agent.name)
    finally:
        store.close()
        await conn.close()


async def test_five_token_commands_join_their_resources_partition(
    nats_url: str, sqlite_url: str
) -> None:
    """A publisher that does not partition: its commands used to travel on another durable
    and overtake the resource's partitioned head (2,3,1)."""
    agent = seq_agent()
    settings = settings_for(
        nats_url, sqlite_url, backoff=(1.5, 1.5, 1.5), max_deliver=4, partitions=2
    )
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    publisher = Publisher(conn.js, settings)
    plain = f"cmd.default.test.{agent.name}.add"

    async def idle() -> bool:
        infos = [await conn.js.consumer_info("MESHFORGE_COMMANDS", f"{agent.name}_consumer_{s}")
                 for s in ("p0", "p1", "unpartitioned")]  # fmt: skip
        return all(i.num_pending == 0 and i.num_ack_pending == 0 for i in infos)

    try:
        async with running([agent], settings, store=store):
            head = Envelope.new(
                f"{agent.name}.add", {"r": "a", "n": 1, "fail": 1}, source="test", resource_id="a"
            )
            await publisher.publish(partitioned(plain, head, settings), head)
            await polling.wait_until(
                lambda: agent.attempts.get(head.id, 0) >= 1,  # type: ignore[attr-defined]
                timeout=10,
                what="the first attempt",
            )
            for n in (2, 3):
                env = Envelope.new(
                    f"{agent.name}.add", {"r": "a", "n": n}, source="test", resource_id="a"
                )
                await publisher.publish(plain, env)  # five tokens
            await polling.wait_until(idle, timeout=30, what="every durable idle")
            assert _applied(store, agent, "a") == [1, 2, 3]
            assert not await dead_letters_of(conn, agent.name)
    finally:
        store.close()
        await conn.close()


async def test_an_agent_may_stay_held_until_an_operator_releases_the_resource(
    nats_url: str, sqlite_url: str
) -> None:
    agent = seq_agent(stay_held=True)
    settings = settings_for(nats_url, sqlite_url, backoff=(0.3, 0.3, 0.3), max_deliver=3)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    metrics = Metrics()
    try:
        async with running([agent], settings, store=store, metrics=metrics):
            bad = await _send(conn, agent, "a", 1, bad=True)
            await polling.wait_until(
                lambda: _has_letters(conn, agent, 1), timeout=15, what="the dead letter"
            )
            for n in (2, 3):
                await _send(conn, agent, "a", n)
            await _send(conn, agent, "b", 1)
            await polling.wait_until(
                lambda: _applied_async(store, agent, "b", [1]), timeout=15, what="b applied"
            )
            consumer = f"{agent.name}_consumer"
            await polling.wait_until(
                lambda: _value(metrics, "meshforge_held_back_total", consumer) >= 2,
                timeout=15,
                what="a and its later commands held",
            )
            assert _applied(store, agent, "a") == []
            listed = _cli("holds", "ls", "--store", sqlite_url, "--agent", agent.name, "--json")
            (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
            assert (row["resource"], row["stopped_by"]) == ("a", bad.key)
            assert _cli("holds", "release", agent.name, "b", "--store", sqlite_url,
                        "--tenant", "default", "--namespace", "test").returncode == 1  # fmt: skip
            done = _cli("holds", "release", agent.name, "a", "--store", sqlite_url,
                        "--tenant", "default", "--namespace", "test")  # fmt: skip
            assert done.returncode == 0, done.stderr
            await polling.wait_until(
                lambda: _applied_async(store, agent, "a", [2, 3]), timeout=20, what="a released"
            )
    finally:
        store.close()
        await conn.close()


async def test_a_head_dead_lettered_at_the_delivery_limit_stops_its_resource_too(
    nats_url: str, sqlite_url: str
) -> None:
    """A head delivered past its limit (another worker took it and died on every attempt)
    is dead-lettered without running, and, as for a dead letter decided in the
    transaction, its resource stays held behind it."""
    agent = seq_agent(stay_held=True)
    settings = settings_for(nats_url, sqlite_url, backoff=(0.3, 0.3, 0.3), max_deliver=2)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    metrics = Metrics()
    consumer = f"{agent.name}_consumer"
    try:
        async with running([agent], settings, store=store):
            pass  # the durable exists
        head = await _send(conn, agent, "a", 1)
        raw = await conn.js.pull_subscribe_bind(consumer, STREAM_COMMANDS)
        for _ in range(2):  # its two attempts, each in a worker that died (nak stands for that)
            [msg] = await raw.fetch(1, timeout=10)
            await msg.nak()
        await raw.unsubscribe()
        for n in (2, 3):
            await _send(conn, agent, "a", n)
        await _send(conn, agent, "b", 1)
        async with running([agent], settings, store=store, metrics=metrics):
            await polling.wait_until(
                lambda: _has_letters(conn, agent, 1), timeout=15, what="the dead letter"
            )
            await polling.wait_until(
                lambda: _applied_async(store, agent, "b", [1]), timeout=15, what="b applied"
            )
            await polling.wait_until(
                lambda: _value(metrics, "meshforge_held_back_total", consumer) >= 2,
                timeout=15,
                what="a's later commands held",
            )
            with store.transaction() as tx:
                views = list_holds(tx, consumer)
            assert [(v.resource, v.stopped_by) for v in views] == [("a", head.key)]
            assert _applied(store, agent, "a") == []
        (letter,) = await dead_letters_of(conn, agent.name)
        assert letter.headers is not None and letter.headers["Dlq-Reason"] == "max_deliveries"
        assert letter.headers["Dlq-Error"] == "attempted 3 times; the limit is 2"
        assert agent.attempts.get(head.id, 0) == 0  # type: ignore[attr-defined]
    finally:
        store.close()
        await conn.close()


async def _has_letters(conn: Any, agent: Agent[Seq], n: int) -> bool:
    return len(await dead_letters_of(conn, agent.name)) >= n


async def _applied_async(store: Any, agent: Agent[Seq], r: str, want: list[int]) -> bool:
    return _applied(store, agent, r) == want


def _value(metrics: Metrics, name: str, consumer: str) -> float:
    return metrics.registry.get_sample_value(name, {"consumer": consumer}) or 0.0


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_")}
    return subprocess.run([sys.executable, "-m", "meshforge", *args], capture_output=True,
                          text=True, env=env, timeout=60, check=False)  # fmt: skip


async def _backlog_then_run(
    conn: Any, agent: Agent[Seq], settings: Any, sends: list[dict[str, Any]]
) -> None:
    """Create the durable, then store ``sends`` before any worker runs: one fetch, one group."""
    async with running([agent], settings):
        pass
    for s in sends:
        await _send(conn, agent, **s)


async def test_a_command_held_behind_a_failure_in_its_own_group_keeps_its_attempts(
    nats_url: str, sqlite_url: str
) -> None:
    """n=1 fails twice; n=2, in the same fetch each time, waits behind it. Those waits are
    not attempts: when n=2 then fails once itself, it has its second attempt, not a dead
    letter as 'attempted 3 times'."""
    agent = seq_agent()
    settings = settings_for(nats_url, sqlite_url, backoff=(1.0, 0.3, 0.3), max_deliver=3)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    try:
        await _backlog_then_run(conn, agent, settings, [
            {"r": "a", "n": 1, "fail": 2}, {"r": "a", "n": 2, "fail": 1},
        ])  # fmt: skip
        async with running([agent], settings, store=store):
            await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
            assert not await dead_letters_of(conn, agent.name)
            assert _applied(store, agent, "a") == [1, 2]
    finally:
        store.close()
        await conn.close()


async def test_a_stop_holds_later_commands_of_the_same_group(
    nats_url: str, sqlite_url: str
) -> None:
    """``hold_after_dead_letter``: n=1 is dead-lettered inside the transaction that also
    holds n=2 and n=3 of its resource; they stay held behind it, as they would in a later
    fetch."""
    agent = seq_agent(stay_held=True)
    settings = settings_for(nats_url, sqlite_url, backoff=(0.3, 0.3, 0.3), max_deliver=3)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    try:
        await _backlog_then_run(conn, agent, settings, [
            {"r": "a", "n": 1, "bad": True}, {"r": "a", "n": 2}, {"r": "a", "n": 3}, {"r": "b", "n": 1},
        ])  # fmt: skip
        async with running([agent], settings, store=store):
            await polling.wait_until(
                lambda: _has_letters(conn, agent, 1), timeout=15, what="the dead letter"
            )
            await polling.wait_until(
                lambda: _applied_async(store, agent, "b", [1]), timeout=15, what="b applied"
            )
            with store.transaction() as tx:
                views = list_holds(tx, f"{agent.name}_consumer")
            assert [(v.resource, v.stopped_by is not None) for v in views] == [("a", True)]
            assert _applied(store, agent, "a") == []
    finally:
        store.close()
        await conn.close()
