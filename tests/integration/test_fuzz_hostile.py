"""Hostile input, generated: random bytes, random JSON, hostile envelopes and headers,
bodies and headers near the server's limits, spoofed tenants, sent to the demo agents on a
real server beside good commands, on both stores.

For every message the server stored, exactly one of two things happens: it is processed
once (one event caused by it) or it is dead-lettered with a reason. The worker never
exits, and every good command interleaved is applied exactly once.

``MESHFORGE_FUZZ_EXAMPLES`` sets the number of generated batches (``make chaos``: more).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine_support import settings_for

import polling
from meshforge.cli.demo_support import StreamMessage, read_stream
from meshforge.demo import InventoryAgent, OrderAgent
from meshforge.envelope import Envelope
from meshforge.runtime.worker import Worker
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_EVENTS, STREAM_FAILED
from meshforge.transport.connection import Connection, connect
from meshforge.transport.server import EmbeddedServer

EXAMPLES = int(os.environ.get("MESHFORGE_FUZZ_EXAMPLES", "10"))
HEADER_LIMIT = 64 * 1024
ALLOWED_REASONS = {"malformed", "unrecoverable", "invalid_payload", "rejected"}
OUTCOME_WAIT = 45.0

# ------------------------------------------------------------------ strategies

_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)
_deep = st.integers(50, 3000).map(lambda n: "[" * n + "]" * n)
_order_payload = st.fixed_dictionaries(
    {},
    optional={
        "order_id": _text | st.just("a\u0000b") | st.integers(),
        "sku": _text | st.just("\u0000") | st.none(),
        "qty": st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | _text,
        "extra": _json,
    },
)


@dataclass(frozen=True)
class Hostile:
    """One generated message: where it goes and how it is built (sizes resolved at send)."""

    tenant: str  # "A" or "B": which of the test's two tenants the subject names
    command: str
    body: Any  # bytes, ("pad", n): n bytes under max_payload, or an envelope dict
    headers: dict[str, str]
    spoof: str | None  # a Tenant-Id header naming the other tenant
    big_header: int | None  # bytes under the 64 KiB header limit


_envelope = st.fixed_dictionaries(
    {"type": st.sampled_from(["order.create", "order.get", "order.zap"]) | _text},
    optional={
        "payload": _order_payload | _json,
        "tenant_id": st.sampled_from(["A", "B", "", "nobody"]),
        "resource_id": _text,
        "idempotency_key": st.sampled_from(["k1", "k2"]) | _text,
        "schema_version": _text,
        "ts": _text,
        "extra": _json,
    },
)
_body = st.one_of(
    st.binary(max_size=256),
    _json.map(lambda v: json.dumps(v).encode()),
    _deep.map(str.encode),
    st.integers(0, 300).map(lambda n: ("pad", n)),
    _envelope,
)
_header_name = st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,15}", fullmatch=True).filter(
    lambda n: n.lower() not in {"nats-msg-id", "nats-expected-stream", "status"}
)
_header_value = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
_hostile = st.builds(
    Hostile,
    tenant=st.sampled_from(["A", "B"]),
    command=st.sampled_from(["create", "get", "zap"]),
    body=_body,
    headers=st.dictionaries(_header_name, _header_value, max_size=3),
    spoof=st.none() | st.just("other"),
    big_header=st.none() | st.integers(64, 2000),
)


# ------------------------------------------------------------------ the running agents


@dataclass
class Rig:
    conn: Connection
    worker: Worker
    task: asyncio.Task[None]
    tenants: dict[str, str]  # "A"/"B" -> this test's tenant names


@pytest.fixture
async def rig(private_server: EmbeddedServer, own_store_url: str) -> AsyncIterator[Rig]:
    config = settings_for(private_server.url, own_store_url, batch_size=16)
    worker = Worker([OrderAgent(), InventoryAgent()], config)
    task = asyncio.create_task(worker.run())
    await polling.wait_until(
        lambda: worker.ready.is_set() or task.done(), timeout=20, what="worker ready"
    )
    assert not task.done(), f"the worker did not start: {task.exception()!r}"
    conn = await connect(config, name="fuzz")
    try:
        yield Rig(
            conn, worker, task, {"A": f"ta{uuid.uuid4().hex[:6]}", "B": f"tb{uuid.uuid4().hex[:6]}"}
        )
    finally:
        await conn.close()
        await worker.stop()
        await asyncio.wait_for(task, 30)


# ------------------------------------------------------------------ sending and checking


@dataclass
class Sent:
    seq: int
    id: str | None  # the envelope id, when the body is an envelope
    good: bool


def _build(
    item: Hostile, tenants: dict[str, str], max_payload: int
) -> tuple[str, bytes, dict[str, str], str | None]:
    tenant = tenants[item.tenant]
    subject = f"cmd.{tenant}.demo.order.{item.command}"
    headers = dict(item.headers)
    env_id: str | None = None
    if isinstance(item.body, tuple):
        data = b"\xff" * max(1, max_payload - item.body[1])
    elif isinstance(item.body, dict):
        env_id = str(uuid.uuid4())
        body = {**item.body, "id": env_id}
        if body.get("tenant_id") in ("A", "B"):
            body["tenant_id"] = tenants[body["tenant_id"]]
        data = json.dumps(body).encode()
        headers["Nats-Msg-Id"] = env_id
    else:
        data = item.body
    if item.spoof:
        headers["Tenant-Id"] = tenants["B" if item.tenant == "A" else "A"]
    if item.big_header:
        headers["X-Big"] = "h" * max(1, HEADER_LIMIT - item.big_header)
    return subject, data, headers, env_id


async def _send(rig: Rig, batch: list[Hostile]) -> list[Sent]:
    """Publish the batch with two good orders around it; what the server refused is not tracked."""
    sent: list[Sent] = []
    nc = await nats.connect(rig.conn.nc.connected_url.geturl(), allow_reconnect=False)  # type: ignore[union-attr]
    try:
        js = nc.jetstream()
        max_payload = nc.max_payload
        goods = [_good(rig, i) for i in range(2)]
        items: list[tuple[str, bytes, dict[str, str], str | None, bool]] = [goods[0]]
        items += [(*_build(h, rig.tenants, max_payload), False) for h in batch]
        items.append(goods[1])
        for subject, data, headers, env_id, good in items:
            try:
                ack = await js.publish(subject, data, headers=headers or None, timeout=5)
            except Exception:
                assert not good, f"a good command was refused: {subject}"
                if not nc.is_connected:
                    await nc.close()
                    nc = await nats.connect(
                        rig.conn.nc.connected_url.geturl(), allow_reconnect=False
                    )  # type: ignore[union-attr]
                    js = nc.jetstream()
                continue
            if not ack.duplicate:
                sent.append(Sent(ack.seq, env_id, good))
    finally:
        await nc.close()
    return sent


def _good(rig: Rig, i: int) -> tuple[str, bytes, dict[str, str], str | None, bool]:
    tenant = rig.tenants["A" if i == 0 else "B"]
    env = Envelope.new(
        "order.create",
        {"order_id": f"good-{uuid.uuid4().hex}", "sku": "S", "qty": 1},
        tenant_id=tenant,
    )
    return f"cmd.{tenant}.demo.order.create", env.encode(), env.headers(), env.id, True


async def _outcomes(
    rig: Rig, sent: list[Sent], events_from: int, failed_from: int
) -> tuple[list[StreamMessage], list[StreamMessage]]:
    """Wait until every sent message is dead-lettered or has caused an event."""
    deadline = time.monotonic() + OUTCOME_WAIT
    while True:
        events = await read_stream(rig.conn.js, STREAM_EVENTS, "evt.>", events_from)
        letters = await read_stream(rig.conn.js, STREAM_FAILED, "failed.cmd.>", failed_from)
        caused = {(e.envelope() or _NO).causation_id for e in events}
        lettered = {int(m.headers.get("Dlq-Stream-Seq", "0")) for m in letters}
        waiting = [
            s for s in sent if s.seq not in lettered and (s.id is None or s.id not in caused)
        ]
        if not waiting:
            return events, letters
        assert not rig.task.done(), f"the worker exited: {rig.task.exception()!r}"
        if time.monotonic() > deadline:
            stuck = [s.seq for s in waiting]
            raise AssertionError(
                f"messages at seq {stuck} were neither processed nor dead-lettered within {OUTCOME_WAIT:g}s"
            )
        await asyncio.sleep(0.05)


_NO = Envelope.new("none.none", {})


async def _last(rig: Rig, stream: str) -> int:
    return int((await rig.conn.js.stream_info(stream)).state.last_seq)


async def _drained(rig: Rig) -> None:
    deadline = time.monotonic() + OUTCOME_WAIT
    while True:
        info = await rig.conn.js.consumer_info(STREAM_COMMANDS, "order_consumer")
        if info.num_pending == 0 and info.num_ack_pending == 0:
            return
        assert time.monotonic() < deadline, (
            f"order_consumer never drained: {info.num_pending} pending, {info.num_ack_pending} unacked"
        )
        await asyncio.sleep(0.05)


@pytest.mark.slow
@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False
)
@given(batch=st.lists(_hostile, min_size=1, max_size=5))
async def test_hostile_messages_are_processed_once_or_dead_lettered(
    rig: Rig, batch: list[Hostile]
) -> None:
    events_from, failed_from = (
        await _last(rig, STREAM_EVENTS) + 1,
        await _last(rig, STREAM_FAILED) + 1,
    )
    sent = await _send(rig, batch)
    events, letters = await _outcomes(rig, sent, events_from, failed_from)
    await _drained(rig)  # nothing left to run: the counts below are final for this batch
    events = await read_stream(rig.conn.js, STREAM_EVENTS, "evt.>", events_from)
    by_cause: dict[str, int] = {}
    for e in events:
        env = e.envelope()
        assert env is not None, f"an event the runtime published does not decode: {e.data[:80]!r}"
        by_cause[env.causation_id or ""] = by_cause.get(env.causation_id or "", 0) + 1
        tenant = e.subject.split(".")[1]
        assert env.tenant_id == tenant, f"event on {e.subject} carries tenant {env.tenant_id!r}"
    for letter in letters:
        reason = letter.headers.get("Dlq-Reason")
        assert reason in ALLOWED_REASONS, (
            f"dead letter {letter.subject} has reason {reason!r}: {letter.headers.get('Dlq-Error')}"
        )
        assert "\n" not in letter.headers.get("Dlq-Error", "")
    lettered = {int(m.headers.get("Dlq-Stream-Seq", "0")) for m in letters}
    for s in sent:
        processed = by_cause.get(s.id or "-", 0)
        if s.good:
            assert processed == 1 and s.seq not in lettered, (
                f"good command {s.id}: {processed} events"
            )
        else:
            assert (processed == 1) != (s.seq in lettered), (
                f"seq {s.seq}: {processed} events, dead letter: {s.seq in lettered}"
            )
    assert not rig.task.done(), "the worker exited"
