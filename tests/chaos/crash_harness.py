"""The crash suite's harness: a worker process killed again and again while commands flow,
and an audit from outside (the wire and the store) that every command had exactly one effect.

Runnable on its own for longer runs::

    .venv/bin/python tests/chaos/crash_harness.py --point after_commit --kills 200
    .venv/bin/python tests/chaos/crash_harness.py --random --kills 100
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from meshforge.cli.demo_support import AgentProcess, StreamMessage, read_stream
from meshforge.config import load_settings
from meshforge.demo import InventoryAgent, OrderAgent
from meshforge.envelope import Envelope, Outbound, derive_id
from meshforge.publish.publisher import Publisher
from meshforge.runtime.agent import derive_uuid
from meshforge.runtime.replay import replay, state_hash
from meshforge.store import Store, StoredEvent, open_store
from meshforge.topology.provision import ensure
from meshforge.topology.specs import agent_consumer, default_streams
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_EVENTS, STREAM_FAILED
from meshforge.transport.connection import Connection, connect
from meshforge.transport.server import EmbeddedServer

AGENTS = ["meshforge.demo:OrderAgent", "meshforge.demo:InventoryAgent"]
SKUS = [f"SKU{i}" for i in range(5)]
# Short waits so redeliveries after a kill come fast; deliveries never run out.
WORKER_ENV = {
    "MESHFORGE_BATCH_SIZE": "8",
    "MESHFORGE_ACK_WAIT": "2s",
    "MESHFORGE_BACKOFF": "1s",
    "MESHFORGE_MAX_DELIVER": "1000",
    "MESHFORGE_SHUTDOWN_TIMEOUT": "5s",
}


# What a worker logs once its metrics endpoint is bound: the port it took.
_METRICS_ON = re.compile(r"metrics on (?:http://)?[^\s:]+:(\d+)")


def scale() -> int:
    """CHAOS_SCALE (``make chaos`` sets 20) multiplies the kill counts."""
    return max(1, int(os.environ.get("CHAOS_SCALE", "1")))


@dataclass
class Run:
    """One chaos run: the server, the store, the worker and everything sent."""

    server: EmbeddedServer
    work: Path
    conn: Connection
    rng: random.Random
    store_url: str = ""
    creates: list[Envelope] = field(default_factory=list)
    stock: list[Envelope] = field(default_factory=list)
    kills: int = 0
    lives: int = 0
    worker: AgentProcess | None = None

    async def provision(self) -> None:
        settings = load_settings(
            {"nats_url": self.server.url, "max_deliver": 1000, "backoff": (1.0,), "ack_wait": 2.0},
            env={},
        )
        await ensure(self.conn.js, default_streams(settings),
                     [agent_consumer("order", settings), agent_consumer("inventory", settings)])  # fmt: skip
        self.store_url = f"sqlite:///{self.work / 'store.db'}"
        self.worker = AgentProcess(AGENTS, self.store_url, self.server.url, self.work / "worker.log",
                                   env=WORKER_ENV, extra_args=["--no-provision"])  # fmt: skip
        self.stock = [Envelope.new("inventory.create", {"sku": s, "qty": 10**9}) for s in SKUS]
        await Publisher(self.conn.js).publish_many(
            [Outbound.of("cmd.default.demo.inventory.create", e) for e in self.stock]
        )

    async def wave(self, n: int) -> None:
        """Send ``n`` more orders."""
        orders = [Envelope.new("order.create", {"sku": self.rng.choice(SKUS), "qty": self.rng.randint(1, 3)})
                  for _ in range(n)]  # fmt: skip
        self.creates += orders
        await Publisher(self.conn.js).publish_many(
            [Outbound.of("cmd.default.demo.order.create", e) for e in orders]
        )

    async def idle(self) -> bool:
        for durable in ("order_consumer", "inventory_consumer"):
            info = await self.conn.js.consumer_info(STREAM_COMMANDS, durable)
            if info.num_pending or info.num_ack_pending:
                return False
        return True

    async def life(
        self, crash_at: str | None, *, kill_after: float | None = None, within: float = 30.0
    ) -> bool:
        """One worker start: until it dies at its crash point, is killed after ``kill_after``
        seconds, or the work is done. True when it died by SIGKILL."""
        assert self.worker is not None
        self.worker.start({"MESHFORGE_CRASH_AT": crash_at} if crash_at else None)
        self.lives += 1
        started = time.monotonic()
        while time.monotonic() - started < within:
            code = self.worker.returncode
            if code is not None:
                died = code == -signal.SIGKILL
                self.kills += died
                if not died:
                    raise AssertionError(
                        f"worker exited with {code}: {self.worker.log_path.read_text()[-3000:]}"
                    )
                return True
            if kill_after is not None and time.monotonic() - started >= kill_after:
                self.worker.kill()
                self.kills += 1
                return True
            if kill_after is None and await self.idle():
                # Its crash point was not reached (no more work came its way): stop it.
                code = self.worker.stop(15)
                if code == -signal.SIGKILL:  # it reached the point while we looked
                    self.kills += 1
                    return True
                # -SIGTERM: stopped before it had even set up its signal handlers.
                assert code in (0, -signal.SIGTERM), self.worker.log_path.read_text()[-3000:]
                return False
            await asyncio.sleep(0.05)  # polling a child process against a deadline
        raise AssertionError(f"worker life did not end within {within}s")

    async def finish(self, within: float = 120.0) -> None:
        """A last worker with no crash point runs until everything is processed, then stops
        gracefully (it must exit 0)."""
        # Port 0, read back from the worker's log (its INFO line): a port picked here could be
        # taken first.
        final = AgentProcess(AGENTS, self.store_url, self.server.url, self.work / "final.log",
                             env={**WORKER_ENV, "MESHFORGE_LOG_LEVEL": "INFO"},
                             extra_args=["--no-provision", "--metrics-port", "0"])  # fmt: skip
        final.start()
        try:
            deadline = time.monotonic() + within
            port = None
            while not (
                (port := port or bound_port(final.log_path))
                and await ready(port)
                and await self.idle()
            ):
                if time.monotonic() > deadline:
                    raise AssertionError("work not finished: " + final.log_path.read_text()[-3000:])
                if final.returncode is not None:
                    raise AssertionError("final worker died: " + final.log_path.read_text()[-3000:])
                await asyncio.sleep(0.1)  # polling against the deadline
            code = final.stop(20)
            assert code == 0, (
                f"graceful stop ended with {code}: " + final.log_path.read_text()[-3000:]
            )
        finally:
            final.kill()

    async def audit(self) -> dict[str, int]:
        """Exactly one effect per command, every output published, nothing lost. Raises if not."""
        events = await read_stream(self.conn.js, STREAM_EVENTS, "evt.>")
        failed = await read_stream(self.conn.js, STREAM_FAILED, "failed.>")
        assert not failed, f"dead letters: {[m.headers.get('Dlq-Error') for m in failed]}"
        info = await self.conn.js.stream_info(STREAM_COMMANDS)
        assert info.state.messages == 0, f"{info.state.messages} commands never processed"
        distinct = audit_events(events, self.creates, self.stock)

        store = await asyncio.to_thread(open_store, self.store_url)
        try:
            return await asyncio.to_thread(self._audit_store, store, distinct)
        finally:
            store.close()

    def _audit_store(self, store: Store, published: set[str | None]) -> dict[str, int]:
        order_effects = {e.key: e for e in store.effects_read("order_consumer")}
        inventory_effects = {e.key: e for e in store.effects_read("inventory_consumer")}
        assert set(order_effects) == {c.key for c in self.creates}
        for c in self.creates:
            outputs = [o.msg_id for o in order_effects[c.key].outputs]
            assert outputs == [derive_id(c.id, 0), derive_id(c.id, 1)]
            assert outputs[0] in published  # the event reached the stream
            assert outputs[1] in inventory_effects  # the command reached (and moved) inventory
        assert set(inventory_effects) == {derive_id(c.id, 1) for c in self.creates} | {
            s.key for s in self.stock
        }
        for effect in inventory_effects.values():
            assert all(o.msg_id in published for o in effect.outputs)
        order = replay(store, "order", OrderAgent())
        inventory = replay(store, "inventory", InventoryAgent())
        assert order.consistent and inventory.consistent
        assert order.events == len(self.creates) and inventory.events == len(self.creates) + len(
            self.stock
        )
        assert order.state_hash == ideal_order_hash(self.creates), (
            "order state hash differs from a clean run"
        )
        want: dict[str, int] = defaultdict(int)
        for c in self.creates:
            want[c.payload["sku"]] += c.payload["qty"]
        assert {s: inventory.states[s].reserved for s in SKUS} == {s: want[s] for s in SKUS}
        return {"commands": len(self.creates), "kills": self.kills, "lives": self.lives}


def bound_port(log: Path) -> int | None:
    """The port a worker started with ``--metrics-port 0`` logged it took, if it has yet."""
    try:
        found = _METRICS_ON.search(log.read_text(errors="replace"))
    except OSError:
        return None
    return int(found.group(1)) if found else None


async def ready(port: int) -> bool:
    """Whether the worker's /readyz answers 200."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    try:
        writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 5)
        return b" 200 " in status
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()


def audit_events(
    events: list[StreamMessage], creates: list[Envelope], stock: list[Envelope]
) -> set[str | None]:
    """Each command's one event, stored ONCE: messages are counted per ``Nats-Msg-Id``, so
    an output published again after the duplicate window shows. Returns the ids seen."""
    copies = Counter(m.headers.get("Nats-Msg-Id") for m in events)
    doubled = {msg_id: n for msg_id, n in copies.items() if n > 1}
    assert not doubled, (
        f"outputs stored more than once in the events stream (id: copies): {doubled}"
    )
    by_cause = _by_cause(events)
    for c in creates:
        reserve = derive_id(c.id, 1)
        assert by_cause[c.id] == {derive_id(c.id, 0)}, f"order {c.id}: events {by_cause[c.id]}"
        assert by_cause[reserve] == {derive_id(reserve, 0)}, (
            f"reserve {reserve}: {by_cause[reserve]}"
        )
    for s in stock:
        assert by_cause[s.id] == {derive_id(s.id, 0)}, f"stock {s.id}: events {by_cause[s.id]}"
    expected = 2 * len(creates) + len(stock)
    assert len(events) == expected, f"{len(events)} event messages, expected {expected}"
    return set(copies)


def _by_cause(events: list[StreamMessage]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for m in events:
        env = m.envelope()
        assert env is not None and env.causation_id is not None
        out[env.causation_id].add(env.id)
    return out


def ideal_order_hash(creates: list[Envelope]) -> str:
    """The order agent's state hash had every command run once, with no crash at all."""
    from datetime import UTC, datetime

    import msgspec

    events = []
    for position, c in enumerate(creates, 1):
        order_id = derive_uuid("order", c.key)
        data = msgspec.json.encode(
            {"order_id": order_id, "sku": c.payload["sku"], "qty": c.payload["qty"]}
        )
        events.append(StoredEvent(
            event_id=derive_id(c.id, 0), type="order.created", resource_id=order_id, command_id=c.id,
            key=c.key, data=data, ts=c.ts, agent="order", position=position, stored_at=datetime.now(UTC),
        ))  # fmt: skip
    return state_hash(events)


async def open_run(work: Path, seed: int) -> tuple[Run, EmbeddedServer]:
    server = EmbeddedServer(store_dir=work / "nats")
    server.start()
    conn = await connect(load_settings({"nats_url": server.url}, env={}), name="chaos")
    run = Run(server=server, work=work, conn=conn, rng=random.Random(seed))
    await run.provision()
    # The stock exists before the first order reserves it (docs/AGENTS.md: a command that
    # needs an earlier one applied is sent once that one's event is out). Otherwise a kill
    # before the stock's commit lets the reservations, delivered at once to the next life,
    # pass the stock, whose redelivery waits for its ack_wait.
    await run.life(None)
    return run, server


async def crash_point_run(work: Path, point: str, kills: int, *, seed: int = 1) -> dict[str, int]:
    """Kill the worker ``kills`` times at ``point``, with load flowing; then finish and audit."""
    run, server = await open_run(work, seed)
    try:
        # Commits overlap publishing only when work keeps coming: bigger waves for that point.
        size = 96 if point == "after_commit_while_publishing" else 24
        while run.kills < kills:
            await run.wave(size)
            # A new count each start, so every life dies a little further on.
            await run.life(f"{point}:{run.rng.randint(1, 4)}")
        await run.finish()
        return await run.audit()
    finally:
        if run.worker is not None:
            run.worker.kill()
        await run.conn.close()
        server.close()


async def random_kill_run(work: Path, kills: int, *, seed: int = 2) -> dict[str, int]:
    """SIGKILL the worker at random moments under load, ``kills`` times; then finish and audit."""
    run, server = await open_run(work, seed)
    try:
        while run.kills < kills:
            await run.wave(40)
            await run.life(None, kill_after=run.rng.uniform(0.8, 2.5))
        await run.finish()
        return await run.audit()
    finally:
        if run.worker is not None:
            run.worker.kill()
        await run.conn.close()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", help="crash point, e.g. after_commit")
    parser.add_argument("--random", action="store_true", help="random-time SIGKILLs instead")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshforge-chaos-") as tmp:
        if args.random:
            result = asyncio.run(random_kill_run(Path(tmp), args.kills, seed=args.seed))
        else:
            result = asyncio.run(crash_point_run(Path(tmp), args.point, args.kills, seed=args.seed))
    print(result)


if __name__ == "__main__":
    sys.exit(main())
