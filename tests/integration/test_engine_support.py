"""Shared pieces of the engine tests: a ledger agent, a running worker, wire and store readers.

(No tests here; the name only keeps it beside the engine tests.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

import polling
from meshforge.cli.demo_support import StreamMessage, read_stream
from meshforge.config import Settings, load_settings
from meshforge.envelope import Envelope, Outbound, decode
from meshforge.errors import Retry
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import Publisher
from meshforge.runtime import Agent, Event, Output, Send, Worker, command
from meshforge.store import Store, open_store
from meshforge.topology.provision import ensure
from meshforge.topology.scope import Scope
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_EVENTS, STREAM_FAILED
from meshforge.transport.connection import Connection, connect


class Account(msgspec.Struct):
    balance: int = 0
    history: list[int] = msgspec.field(default_factory=list)


def ledger_agent(name: str | None = None) -> Agent[Account]:
    """A fresh agent with a unique name, so tests on the shared server never meet.

    ``credit {"account", "amount", "mode"?}`` emits ``credited`` and sends ``<name>x.notify``;
    ``mode`` makes the handler fail: ``invalid`` (ValueError), ``missing`` (KeyError),
    ``flaky`` (RuntimeError the first ``times`` deliveries), ``slow`` (sleeps ``seconds``),
    ``bug`` (ZeroDivisionError every time), ``retry`` (Retry with delay 0.1), ``huge`` (an
    event of ``bytes`` bytes).
    """
    agent_name = name or f"led{uuid.uuid4().hex[:8]}"
    failures: dict[str, int] = {}

    class Ledger(Agent[Account]):
        name = agent_name
        calls: list[tuple[str, int]] = []  # (command id, balance seen), in call order

        @command("credit", key="account")
        async def credit(self, cmd: Envelope, state: Account) -> list[Output]:
            p = cmd.payload
            self.calls.append((cmd.id, state.balance))
            mode = p.get("mode")
            if mode in ("invalid", "missing", "bug", "flaky"):
                state.history.append(-999)  # in place on purpose: the engine must undo it
            if mode == "invalid":
                raise ValueError(f"amount must be positive, got {p.get('amount')!r}")
            if mode == "missing":
                p["no_such_field"]
            if mode == "bug":
                _ = 1 / 0
            if mode == "retry" and failures.setdefault(cmd.key, 0) < 1:
                failures[cmd.key] += 1
                raise Retry("try again", delay=0.1)
            if mode == "flaky" and failures.setdefault(cmd.key, 0) < int(p["times"]):
                failures[cmd.key] += 1
                raise RuntimeError("flaky backend")
            if mode == "flaky":
                state.history.pop()
            if mode == "slow":
                await asyncio.sleep(float(p["seconds"]))
            amount = int(p["amount"])
            if mode == "huge":  # an event larger than the server takes
                return [
                    Event(
                        "credited",
                        {"account": p["account"], "amount": amount, "pad": "x" * int(p["bytes"])},
                    )
                ]
            return [
                Event("credited", {"account": p["account"], "amount": amount,
                                   "balance": state.balance + amount}),
                Send(agent_name + "x", "notify", {"account": p["account"]}),
            ]  # fmt: skip

        def apply(self, state: Account, event: Event) -> Account:
            if event.name == "credited":
                amount = int(event.payload["amount"])
                return Account(balance=state.balance + amount, history=[*state.history, amount])
            return state

    return Ledger()


# Where ``send`` puts commands (``cmd.default.test.…``): the scope of what they keep.
SCOPE = Scope("default", "test")


def settings_for(nats_url: str, store_url: str, **values: Any) -> Settings:
    base: dict[str, Any] = {
        "nats_url": nats_url,
        "store_url": store_url,
        "ack_wait": 2.0,
        # The first entry is a delivery's first ack wait: a second, so a stalled machine does
        # not redeliver what a test expects once (0.2 s did, 3017b67); the later ones are short.
        "backoff": (1.0, 0.4, 0.6),
        "max_deliver": 4,
        "shutdown_timeout": 5.0,
    }
    base.update(values)
    return load_settings(base, env={})


@contextlib.asynccontextmanager
async def running(
    agents: list[Agent[Any]], settings: Settings, *, store: Store | None = None,
    metrics: Metrics | None = None,
) -> AsyncIterator[Worker]:  # fmt: skip
    """A worker running ``agents`` in this process, stopped gracefully at the end."""
    worker = Worker(agents, settings, store=store, metrics=metrics or Metrics())
    task = asyncio.create_task(worker.run())
    ready = asyncio.create_task(worker.ready.wait())
    done, _ = await asyncio.wait({task, ready}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        ready.cancel()
        task.result()
    assert ready in done, "worker did not become ready"
    try:
        yield worker
    finally:
        await worker.stop()
        await asyncio.wait_for(task, 30)


async def send(
    conn: Connection, agent: str, cmd: str, payload: dict[str, Any], **fields: Any
) -> Envelope:
    env = Envelope.new(f"{agent}.{cmd}", payload, source="test", **fields)
    await Publisher(conn.js).publish(f"cmd.default.test.{agent}.{cmd}", env)
    return env


async def send_many(conn: Connection, envs: list[tuple[str, Envelope]]) -> None:
    await Publisher(conn.js).publish_many([Outbound.of(subject, env) for subject, env in envs])


async def wait_until(
    check: Callable[[], Awaitable[bool]], within: float = 20.0, what: str = ""
) -> None:
    await polling.wait_until(check, timeout=within, what=what or "condition")


async def events_of(conn: Connection, agent: str) -> list[StreamMessage]:
    return await read_stream(conn.js, STREAM_EVENTS, f"evt.*.*.{agent}.>")


async def dead_letters_of(conn: Connection, agent: str) -> list[StreamMessage]:
    return await read_stream(conn.js, STREAM_FAILED, f"failed.cmd.*.*.{agent}.>")


async def consumer_idle(conn: Connection, agent: str) -> bool:
    """The agent's consumer exists and has nothing pending or unacknowledged."""
    try:
        info = await conn.js.consumer_info("MESHFORGE_COMMANDS", f"{agent}_consumer")
    except NotFoundError:
        return False  # not provisioned yet
    return info.num_pending == 0 and info.num_ack_pending == 0


class Tap:
    """Every message published on a subject, as sent (duplicates the stream drops included)."""

    def __init__(self) -> None:
        self.msgs: list[Msg] = []

    @classmethod
    async def on(cls, nc: NATS, subject: str) -> Tap:
        tap = cls()

        async def cb(msg: Msg) -> None:
            tap.msgs.append(msg)

        await nc.subscribe(subject, cb=cb)
        await nc.flush()
        return tap

    def ids(self) -> list[str]:
        return [(m.headers or {}).get("Nats-Msg-Id", "") for m in self.msgs]


async def open_conn(settings: Settings) -> Connection:
    """A connection, with the CONTRACT streams in place (a test may publish before a worker runs)."""
    conn = await connect(settings, name="engine-test")
    await ensure(conn.js, default_streams(settings))
    return conn


async def open_store_async(url: str) -> Store:
    return await asyncio.to_thread(open_store, url)


@dataclass(frozen=True)
class Seen:
    """An event as it arrived: its subject and its envelope's fields."""

    subject: str
    env: Envelope

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


class EventWatchFor:
    """Every event published on a subject, as sent; waits for the ones a test expects."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self._changed = asyncio.Event()
        self._sub: Any = None

    @classmethod
    async def start(cls, conn: Connection, subject: str) -> EventWatchFor:
        watch = cls()

        async def cb(msg: Msg) -> None:
            watch.seen.append(Seen(msg.subject, decode(msg.data, dict(msg.headers or {}))))
            watch._changed.set()

        watch._sub = await conn.nc.subscribe(subject, cb=cb)
        await conn.nc.flush()
        return watch

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()

    async def first(
        self, predicate: Callable[[Seen], bool], *, after: int = 0, within: float = 20.0
    ) -> Seen:
        deadline = time.monotonic() + within
        index = after
        while True:
            while index < len(self.seen):
                if predicate(self.seen[index]):
                    return self.seen[index]
                index += 1
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no matching event within {within}s; saw {[s.type for s in self.seen]}"
                )
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(deadline - time.monotonic(), 0.01))

    async def caused_by(self, cmd: Envelope, within: float = 20.0) -> Seen:
        return await self.first(lambda s: s.causation_id == cmd.id, within=within)

    async def caused_by_id(self, cmd_id: str, within: float = 20.0) -> Seen:
        return await self.first(lambda s: s.causation_id == cmd_id, within=within)
