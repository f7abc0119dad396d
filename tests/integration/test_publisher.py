"""Publisher against a real nats-server: ids, duplicates, retries, permanent errors, pipelining."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.config import Settings, load_settings
from meshforge.envelope import H_MSG_ID, Envelope, Outbound
from meshforge.errors import MeshForgeError, PublishError
from meshforge.ops.observability import Metrics
from meshforge.publish.publisher import NO_STREAM_ATTEMPTS, Publisher
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_EVENTS
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer


def settings(**values: object) -> Settings:
    return load_settings(values, env={})


def count(metric: object, **labels: str) -> float:
    return float(metric.labels(**labels)._value.get())  # type: ignore[attr-defined]


async def subject_count(js: JetStreamContext, stream: str, subject: str) -> int:
    info = await js.stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


@pytest.fixture(params=["nats-py", "meshforge"])
async def streams(
    request: pytest.FixtureRequest, js: JetStreamContext, nats_url: str
) -> AsyncIterator[JetStreamContext]:
    """JetStream on a plain nats-py client, and on a MeshForge connection (whose publishes
    take the lean path of ``meshforge.transport.pubacks``): the publisher behaves the same on both."""
    await ensure(js, default_streams(settings()), [])
    if request.param == "nats-py":
        yield js
        return
    async with await connect(settings(), url=nats_url) as conn:
        yield conn.js


def in_flight(js: JetStreamContext) -> int:
    """PubAcks awaited now, on either path."""
    pipe = getattr(js._nc, "_pipe", None)
    return js.publish_async_pending() + (pipe.pending if pipe is not None else 0)


@pytest.fixture
async def own_subject(streams: JetStreamContext) -> AsyncIterator[str]:
    """An event subject of this test alone, purged afterwards so other tests do not see it."""
    subject = f"evt.pubtest.t{uuid.uuid4().hex[:8]}.order.created"
    yield subject
    await streams.purge_stream(STREAM_EVENTS, subject=subject)


async def test_envelope_publish_and_duplicate(streams: JetStreamContext, own_subject: str) -> None:
    metrics = Metrics()
    pub = Publisher(streams, settings(), metrics)
    # The subject names the tenant: an envelope left at the default is sent as that tenant's.
    env = Envelope.new("order.created", {"order_id": "o-1"}, tenant_id="pubtest")
    first = await pub.publish(own_subject, env)
    assert (first.stream, first.duplicate, first.msg_id) == (STREAM_EVENTS, False, env.id)
    again = await pub.publish(own_subject, env)
    assert again.duplicate is True
    assert again.seq == first.seq
    assert await subject_count(streams, STREAM_EVENTS, own_subject) == 1
    stored = await streams.get_msg(STREAM_EVENTS, first.seq)
    assert stored.data == env.encode()
    assert stored.headers is not None
    for name, value in env.headers().items():
        assert stored.headers[name] == value
    assert count(metrics.published, stream=STREAM_EVENTS) == 1
    assert count(metrics.publish_duplicates, stream=STREAM_EVENTS) == 1


async def test_bytes_get_headers_and_an_id(streams: JetStreamContext, own_subject: str) -> None:
    pub = Publisher(streams, settings(), Metrics())
    msg_id = f"raw-{uuid.uuid4().hex}"  # not a duplicate of another run's
    given = await pub.publish(own_subject, b'{"raw": 1}', headers={"X-Test": "yes"}, msg_id=msg_id)
    stored = await streams.get_msg(STREAM_EVENTS, given.seq)
    assert stored.headers == {"X-Test": "yes", H_MSG_ID: msg_id}
    # No id given: one is made, so a retried attempt could not be stored twice.
    made = await pub.publish(own_subject, b"{}")
    assert made.msg_id
    stored = await streams.get_msg(STREAM_EVENTS, made.seq)
    assert stored.headers == {H_MSG_ID: made.msg_id}


@pytest.mark.parametrize(
    "subject", ["evt.default.demo.*.created", "evt.default..order", "evt.a b", "evt.default.>", ""]
)
async def test_invalid_subject_is_refused_before_sending(
    streams: JetStreamContext, subject: str
) -> None:
    metrics = Metrics()
    pub = Publisher(streams, settings(), metrics)
    with pytest.raises(PublishError) as info:
        await pub.publish(subject, b"{}")
    assert info.value.kind == "invalid_subject"
    assert not info.value.retriable
    assert repr(subject) in str(info.value)
    assert count(metrics.publish_failures, kind="invalid_subject") == 1


async def test_no_stream_fails_after_a_few_quick_attempts(streams: JetStreamContext) -> None:
    metrics = Metrics()
    pub = Publisher(streams, settings(publish_attempts=10), metrics)
    subject = f"nostream.{uuid.uuid4().hex[:8]}.x"
    started = time.monotonic()
    with pytest.raises(PublishError) as info:
        await pub.publish(subject, b"{}")
    elapsed = time.monotonic() - started
    assert info.value.kind == "no_stream"
    assert repr(subject) in str(info.value)
    assert "meshforge provision" in str(info.value)
    assert count(metrics.publish_retries, kind="no_stream") == NO_STREAM_ATTEMPTS - 1
    assert count(metrics.publish_failures, kind="no_stream") == 1
    # Quick is the feature: two backoffs of at most 0.1 and 0.2 s (over 5x that here), not a
    # 5 s publish timeout per attempt.
    assert elapsed < 2.0


async def test_payload_over_max_payload_fails_at_once(
    streams: JetStreamContext, own_subject: str
) -> None:
    metrics = Metrics()
    pub = Publisher(streams, settings(), metrics)
    with pytest.raises(PublishError) as info:
        await pub.publish(own_subject, b"x" * (1024 * 1024 + 1))
    assert info.value.kind == "payload_too_large"
    assert "max_payload of 1048576 bytes" in str(info.value)
    assert count(metrics.publish_retries, kind="payload_too_large") == 0


async def test_server_side_refusals_are_permanent(js: JetStreamContext) -> None:
    name = f"PUBT_{uuid.uuid4().hex[:6].upper()}"
    await js.add_stream(StreamConfig(name=name, subjects=[f"{name.lower()}.>"], max_msg_size=1000))
    try:
        metrics = Metrics()
        pub = Publisher(js, settings(), metrics)
        subject = f"{name.lower()}.x"
        with pytest.raises(PublishError) as big:
            await pub.publish(subject, b"x" * 2000)
        assert big.value.kind == "payload_too_large"
        assert "message size exceeds maximum allowed" in str(big.value)
        with pytest.raises(PublishError) as seq:
            await pub.publish(subject, b"x", headers={"Nats-Expected-Last-Sequence": "41"})
        assert seq.value.kind == "wrong_last_seq"
        assert (
            sum(
                count(metrics.publish_retries, kind=k)
                for k in ("payload_too_large", "wrong_last_seq")
            )
            == 0
        )
    finally:
        await js.delete_stream(name)


async def test_permission_denied_is_not_retried(tmp_path: Path) -> None:
    conf = tmp_path / "server.conf"
    conf.write_text(
        "authorization { users = [ {user: limited, password: pw, permissions: {"
        ' publish: {allow: ["evt.>", "$JS.API.>"]}, subscribe: {allow: ["_INBOX_limited.>"]}}} ] }\n'
    )
    async with EmbeddedServer(store_dir=tmp_path / "nats", extra_args=["-c", str(conf)]) as server:
        s = settings(user="limited", password="pw", publish_timeout=0.5, publish_attempts=5)
        async with await connect(s, url=server.url) as conn:
            metrics = Metrics()
            pub = Publisher(conn.js, s, metrics)
            with pytest.raises(PublishError) as info:
                await pub.publish("cmd.default.demo.order.create", Envelope.new("order.create", {}))
            assert info.value.kind == "permission_denied"
            assert "cmd.default.demo.order.create" in str(info.value)
            # One attempt, not five: counted, not timed (five quick refusals fit in 2 s too).
            assert count(metrics.publish_retries, kind="permission_denied") == 0
            outcomes = await pub.publish_each([Outbound("cmd.default.demo.x.y", b"{}", {}, "p-1")])
            assert isinstance(outcomes[0], PublishError)
            assert outcomes[0].kind == "permission_denied"
            assert count(metrics.publish_retries, kind="permission_denied") == 0
            # The client lower-cases the server's error: a tenant with capitals is still named.
            with pytest.raises(PublishError) as info:
                await pub.publish("cmd.TenantA.demo.order.create", Envelope.new("order.create", {}))
            assert info.value.kind == "permission_denied"


async def test_retries_through_a_server_kill_and_restart(private_server: EmbeddedServer) -> None:
    s = settings(
        publish_timeout=1.0, publish_attempts=30, publish_backoff_base=0.05, publish_backoff_cap=0.5
    )
    total = 200
    async with await connect(s, url=private_server.url) as conn:
        await ensure(conn.js, default_streams(s), [])
        metrics = Metrics()
        pub = Publisher(conn.js, s, metrics)
        subject = "evt.default.demo.order.created"
        envs = [Envelope.new("order.created", {"n": i}) for i in range(total)]
        results = []

        async def produce() -> None:
            for env in envs:
                results.append(await pub.publish(subject, env))

        task = asyncio.create_task(produce())
        deadline = time.monotonic() + 20
        while len(results) < 50:
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.005)  # polling progress with a deadline
        await asyncio.to_thread(private_server.kill)
        await asyncio.to_thread(private_server.start)
        await asyncio.wait_for(task, 60)

        assert [r.msg_id for r in results] == [e.id for e in envs]
        assert len({r.seq for r in results}) == total
        retried = sum(
            count(metrics.publish_retries, kind=k)
            for k in ("timeout", "connection", "no_stream", "unavailable")
        )
        assert retried > 0, "the kill did not interrupt any publish"
        assert await subject_count(conn.js, STREAM_EVENTS, subject) == total


async def test_publish_many_through_a_server_kill_and_restart(
    private_server: EmbeddedServer,
) -> None:
    s = settings(
        publish_timeout=1.0, publish_attempts=30, publish_backoff_base=0.05, publish_backoff_cap=0.5
    )
    total = 6000
    subject = "evt.default.demo.order.created"
    async with (
        await connect(s, url=private_server.url) as conn,
        await connect(s, url=private_server.url) as watcher,
    ):
        await ensure(conn.js, default_streams(s), [])
        metrics = Metrics()
        pub = Publisher(conn.js, s, metrics)
        items = [
            Outbound.of(subject, Envelope.new("order.created", {"n": i})) for i in range(total)
        ]
        task = asyncio.create_task(pub.publish_many(items, max_in_flight=128))
        deadline = time.monotonic() + 20
        while await subject_count(watcher.js, STREAM_EVENTS, subject) < 300:
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.002)  # polling progress with a deadline
        await asyncio.to_thread(private_server.kill)
        await asyncio.to_thread(private_server.start)
        results = await asyncio.wait_for(task, 90)

        assert [r.msg_id for r in results] == [i.msg_id for i in items]
        assert len({r.seq for r in results}) == total
        assert sum(count(metrics.publish_retries, kind=k) for k in ("timeout", "connection")) > 0
        deadline = time.monotonic() + 20
        while (stored := await subject_count(conn.js, STREAM_EVENTS, subject)) != total:
            assert stored < total and time.monotonic() < deadline, f"{stored} stored"
            await asyncio.sleep(0.05)  # buffered copies may still be landing as duplicates


async def test_publish_many_ten_thousand_bounded(
    streams: JetStreamContext, own_subject: str
) -> None:
    metrics = Metrics()
    pub = Publisher(streams, settings(), metrics)
    items = [
        Outbound.of(own_subject, Envelope.new("order.created", {"n": i})) for i in range(10_000)
    ]
    peak = 0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, in_flight(streams))
            await asyncio.sleep(0)  # yield to the publisher between samples

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    try:
        results = await pub.publish_many(items, max_in_flight=64)
    finally:
        done.set()
        await sampler
    elapsed = time.monotonic() - started
    print(f"publish_many: {len(items) / elapsed:.0f} msg/s")
    assert [r.msg_id for r in results] == [i.msg_id for i in items]
    seqs = [r.seq for r in results]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # stored in the order given
    assert not any(r.duplicate for r in results)
    assert 1 < peak <= 64
    assert await subject_count(streams, STREAM_EVENTS, own_subject) == 10_000
    assert count(metrics.published, stream=STREAM_EVENTS) == 10_000

    again = await pub.publish_many(items[:100])
    assert all(r.duplicate for r in again)
    assert [r.seq for r in again] == seqs[:100]


async def test_publish_many_on_stock_nats_py_never_waits_in_its_pending_limit(
    js: JetStreamContext,
) -> None:
    """With nats-py's own pending limit as large as the window (the caller sized both
    alike), a full window waits for a quarter of it to come back, lets nats-py count those
    PubAcks in, and sends the next messages together: none waits in nats-py's limit (a
    wait there is a PubAck, a wake-up and a write of its own for every message). A PubAck
    answered while the window sends on frees its place a callback later, so a loaded
    machine may see a few; one by one, it was 3.4% of them here."""
    await ensure(js, default_streams(settings()), [])
    subject = f"evt.pubtest.t{uuid.uuid4().hex[:8]}.order.created"
    window, total = 64, 10_000
    stock = js._nc.jetstream(publish_async_max_pending=window)
    send = stock.publish_async
    sent = blocked = 0

    async def watched(*args: Any, **kwargs: Any) -> Any:
        nonlocal sent, blocked
        sent += 1
        blocked += stock.publish_async_pending() >= window  # it would wait for a place
        return await send(*args, **kwargs)

    stock.publish_async = watched  # type: ignore[method-assign]
    items = [Outbound.of(subject, Envelope.new("order.created", {"n": i})) for i in range(total)]
    try:
        results = await Publisher(stock, settings(), Metrics()).publish_many(
            items, max_in_flight=window
        )
    finally:
        await js.purge_stream(STREAM_EVENTS, subject=subject)
    seqs = [r.seq for r in results]
    assert sent == total and seqs == sorted(seqs) and len(set(seqs)) == total
    assert blocked <= total // 200, (
        f"{blocked} of {total} messages waited in nats-py's pending limit"
    )


async def test_publish_many_reports_the_first_failure(
    streams: JetStreamContext, own_subject: str
) -> None:
    pub = Publisher(streams, settings(), Metrics())
    run = uuid.uuid4().hex[:8]  # ids of this run alone: no duplicate of another run's
    items = [
        Outbound(own_subject, b"{}", {}, f"{run}-0"),
        Outbound(own_subject, b"x" * (1024 * 1024 + 10), {}, f"{run}-1"),
        Outbound("evt.bad.*", b"{}", {}, f"{run}-2"),
        Outbound(own_subject, b"{}", {}, f"{run}-3"),
    ]
    with pytest.raises(PublishError) as info:
        await pub.publish_many(items)
    assert str(info.value).startswith(f"message 1 of 4 (msg id '{run}-1') failed (2 failed in all)")
    assert info.value.kind == "payload_too_large"
    outcomes = await pub.publish_each(items)
    assert [type(o).__name__ for o in outcomes] == [
        "PublishResult",
        "PublishError",
        "PublishError",
        "PublishResult",
    ]
    assert await subject_count(streams, STREAM_EVENTS, own_subject) == 2


# ------------------------------------------------------------------ the CLI


def test_cli_publish_payload_and_envelope(nats_url: str) -> None:
    runner = CliRunner()
    agent = f"t{uuid.uuid4().hex[:6]}"
    subject = f"cmd.default.demo.{agent}.create"
    asyncio.run(_provision(nats_url))
    key = str(uuid.uuid4())
    out = runner.invoke(
        app, ["publish", subject, '{"sku": "A-1", "qty": 2}', "--nats-url", nats_url, "--key", key]
    )
    assert out.exit_code == 0, out.output
    fields = dict(part.split("=", 1) for part in out.stdout.split())
    assert fields["stream"] == STREAM_COMMANDS
    assert fields["duplicate"] == "false"
    stored = asyncio.run(_get(nats_url, STREAM_COMMANDS, int(fields["seq"])))
    body = json.loads(stored[0])
    assert body["type"] == f"{agent}.create"
    assert body["tenant_id"] == "default"
    assert body["payload"] == {"sku": "A-1", "qty": 2}
    assert body["idempotency_key"] == key
    assert body["source"] == "cli"
    assert stored[1][H_MSG_ID] == fields["id"] == body["id"]

    whole = json.dumps(
        {"id": "fixed-1", "type": "order.create", "payload": {"sku": "B"}, "extra_field": 1}
    )
    first = runner.invoke(app, ["publish", subject, whole, "--nats-url", nats_url])
    second = runner.invoke(app, ["publish", subject, whole, "--nats-url", nats_url])
    assert "id=fixed-1" in first.stdout and "duplicate=false" in first.stdout
    assert "duplicate=true" in second.stdout
    stored = asyncio.run(
        _get(nats_url, STREAM_COMMANDS, int(first.stdout.split("seq=")[1].split()[0]))
    )
    assert json.loads(stored[0])["extra_field"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cmd.default.demo.order.create", "{not json"], "JSON argument is not valid JSON"),
        (["cmd.default.demo.order.create", "[1, 2]"], "JSON argument must be an object"),
        (["control.cmd.lab1.node7", '{"x": 1}'], "give a whole envelope"),
        (["cmd.default.demo.*.create", "{}"], "invalid subject"),
    ],
)
def test_cli_publish_bad_arguments_are_usage_errors(
    nats_url: str, args: list[str], message: str
) -> None:
    out = CliRunner().invoke(app, ["publish", *args, "--nats-url", nats_url])
    assert out.exit_code == 2, out.output
    errors = [line for line in out.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0]


def test_cli_publish_outside_every_stream_names_the_streams_not_provision(nats_url: str) -> None:
    whole = json.dumps({"type": "x.y", "payload": {}})
    out = CliRunner().invoke(app, ["publish", "foo.bar", whole, "--nats-url", nats_url])
    assert isinstance(out.exception, MeshForgeError), out.output
    text = str(out.exception)
    assert "'foo.bar'" in text and "cmd.>" in text and "provision" not in text
    assert "\n" not in text


async def _provision(url: str) -> None:
    async with await connect(settings(), url=url) as conn:
        await ensure(conn.js, default_streams(settings()), [])


async def _get(url: str, stream: str, seq: int) -> tuple[bytes, dict[str, str]]:
    async with await connect(settings(), url=url) as conn:
        msg = await conn.js.get_msg(stream, seq)
        await conn.js.delete_msg(stream, seq)
        return msg.data or b"", dict(msg.headers or {})
