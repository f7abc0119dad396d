"""The lean publish path of a MeshForge connection (``meshforge.transport.pubacks``), its batched
acks and its direct delivery, against a real nats-server: the same answers nats-py gives."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck

from meshforge.config import load_settings
from meshforge.consume.pull import PullSource
from meshforge.envelope import Outbound
from meshforge.transport.connection import Connection, connect


@pytest.fixture
async def conn(nats_url: str) -> AsyncIterator[Connection]:
    async with await connect(load_settings({}, env={}), url=nats_url) as c:
        yield c


@pytest.fixture
async def stream(js: JetStreamContext) -> AsyncIterator[str]:
    """A stream of this test alone on ``<name>.>``, small messages only (256 bytes)."""
    name = f"PIPE_{uuid.uuid4().hex[:8]}"
    await js.add_stream(name=name, subjects=[f"{name.lower()}.>"], max_msg_size=256)
    yield name
    await js.delete_stream(name)


def item(subject: str, data: bytes = b"{}", **headers: str) -> Outbound:
    msg_id = uuid.uuid4().hex
    return Outbound(subject, data, {"Nats-Msg-Id": msg_id, **headers}, msg_id)


async def test_answers_come_in_order_with_the_window_respected(
    conn: Connection, js: JetStreamContext, stream: str
) -> None:
    pipe = conn.nc.pubacks()  # type: ignore[attr-defined]
    items = [item(f"{stream.lower()}.a") for _ in range(3000)]
    peak = 0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, pipe.pending)
            await asyncio.sleep(0)

    sampler = asyncio.create_task(sample())
    try:
        answers = await pipe.publish(items, max_in_flight=64, answer_within=5.0)
    finally:
        done.set()
        await sampler
    assert all(isinstance(a, PubAck) and a.stream == stream for a in answers)
    seqs = [a.seq for a in answers if isinstance(a, PubAck)]
    assert seqs == list(range(1, 3001))
    assert 1 < peak <= 64 and pipe.pending == 0
    again = await pipe.publish(items[:10], max_in_flight=64, answer_within=5.0)
    assert [a.duplicate for a in again if isinstance(a, PubAck)] == [True] * 10


async def test_each_refusal_is_its_own_answer_as_nats_py_gives_it(
    conn: Connection, js: JetStreamContext, stream: str
) -> None:
    subject = f"{stream.lower()}.b"
    items = [
        item(subject),
        item(f"nowhere{uuid.uuid4().hex[:6]}.x"),  # no stream, no subscriber: 503
        item(subject, b"x" * 300),  # over the stream's max_msg_size
        item(subject, **{"Bad Name": "x"}),  # a header name nats-py refuses
        item(subject, b"x" * (conn.nc.max_payload + 1)),  # over the server's max_payload
        item(subject),
    ]
    answers = await conn.nc.pubacks().publish(items, max_in_flight=256, answer_within=5.0)  # type: ignore[attr-defined]
    kinds = [type(a) for a in answers]
    assert kinds[0] is PubAck and kinds[5] is PubAck
    assert kinds[1] is nats.js.errors.NoStreamResponseError
    assert isinstance(answers[2], nats.js.errors.APIError) and "size" in str(answers[2]).lower()
    assert kinds[3] is nats.errors.BadHeaderError
    assert kinds[4] is nats.errors.MaxPayloadError
    # What nats-py answers for the same refused message, for comparison.
    with pytest.raises(nats.js.errors.APIError) as plain:
        await js.publish(subject, b"x" * 300)
    assert type(plain.value) is type(answers[2])


async def test_headers_are_written_exactly_as_nats_py_writes_them(
    conn: Connection, js: JetStreamContext, stream: str
) -> None:
    subject = f"{stream.lower()}.c"
    headers = {
        "X-Spaced": "  padded  ",
        "X-Lines": "one\r\ntwo\nthree",
        " X-Trim ": "v",
        "": "gone",
    }
    ours = await conn.nc.pubacks().publish(
        [Outbound(subject, b"1", headers, "")], max_in_flight=8, answer_within=5.0
    )  # type: ignore[attr-defined]
    theirs = await js.publish(subject, b"2", headers=dict(headers))
    assert isinstance(ours[0], PubAck)
    mine, plain = await js.get_msg(stream, ours[0].seq), await js.get_msg(stream, theirs.seq)
    assert mine.headers == plain.headers
    assert mine.headers is not None and mine.headers["X-Lines"] == "one  two three"


async def test_a_pub_ack_that_never_comes_is_a_timeout_within_its_bound(conn: Connection) -> None:
    # A plain subscriber on the publishing connection itself takes each message and never
    # answers: no PubAck, and no 503 either, as the subject has interest throughout.
    subject = f"silent.{uuid.uuid4().hex[:8]}"
    sub = await conn.nc.subscribe(subject)
    await conn.nc.flush()
    started = time.monotonic()
    answers = await conn.nc.pubacks().publish(  # type: ignore[attr-defined]
        [item(subject) for _ in range(20)], max_in_flight=8, answer_within=0.3
    )
    elapsed = time.monotonic() - started
    await sub.unsubscribe()
    assert [type(a) for a in answers] == [nats.errors.TimeoutError] * 20, answers
    # The bound is the feature: three windows of at most 8, each waiting its 0.3 s at most
    # (0.9 s), 5x for a loaded machine; one wait per message would take 6 s.
    assert elapsed < 5 * 3 * 0.3, elapsed
    assert conn.nc.pubacks().pending == 0  # type: ignore[attr-defined]


async def test_a_closed_connection_refuses_every_message(nats_url: str) -> None:
    c = await connect(load_settings({}, env={}), url=nats_url)
    pipe = c.nc.pubacks()  # type: ignore[attr-defined]
    await c.close()
    answers = await pipe.publish([item("x.y"), item("x.z")], max_in_flight=8, answer_within=1.0)
    assert [type(a) for a in answers] == [nats.errors.ConnectionClosedError] * 2


async def test_ack_many_acks_every_message_once_and_direct_delivery_keeps_order(
    conn: Connection, js: JetStreamContext, stream: str
) -> None:
    subject = f"{stream.lower()}.d"
    for i in range(50):
        await js.publish(subject, str(i).encode())
    await js.add_consumer(stream, durable_name="acker", ack_policy="explicit", ack_wait=30)
    source = PullSource(conn.nc, stream, "acker")
    await source.start()  # on a MeshForge connection: delivered without a queue hop
    got: list[Msg] = []
    while len(got) < 50:
        got += (await source.fetch(50 - len(got))).messages
    assert [m.data for m in got] == [str(i).encode() for i in range(50)]
    await conn.nc.ack_many(got)  # type: ignore[attr-defined]
    # The server applies acks on its own time: poll, with a deadline.
    deadline = time.monotonic() + 10
    while (info := await js.consumer_info(stream, "acker")).num_ack_pending:
        assert time.monotonic() < deadline, f"{info.num_ack_pending} still unacknowledged"
        await asyncio.sleep(0.05)
    assert info.ack_floor.stream_seq == 50
    with pytest.raises(nats.errors.MsgAlreadyAckdError):
        await conn.nc.ack_many(got[:1])  # type: ignore[attr-defined]


async def test_a_source_closed_while_a_message_is_on_its_way_hands_it_back(
    conn: Connection, js: JetStreamContext, stream: str
) -> None:
    """A fetch given up on (its consumer is stopping) leaves a request the server may still
    answer; a message it sends as the source closes must come back to the caller (to nak),
    not be dropped on arrival: dropped, it stays unacknowledged until its ack wait runs
    out, and a partition handed to another worker meanwhile has that worker apply the
    resource's later commands first. Closing returns what came; the rest was not sent."""
    subject = f"{stream.lower()}.c"
    lost: list[int] = []
    for rounds in range(30):
        durable = f"closing{rounds}"
        await js.add_consumer(stream, durable_name=durable, ack_policy="explicit", ack_wait=60,
                              deliver_policy="new")  # fmt: skip
        await js.publish(subject, b"x")
        source = PullSource(conn.nc, stream, durable)
        await source.start()
        stopping = asyncio.Event()
        stopping.set()  # the request goes out, and the fetch gives up on it at once
        given = (await source.fetch(4, stopping)).messages
        given += await source.close()
        await conn.nc.flush()
        if (await js.consumer_info(stream, durable)).num_ack_pending != len(given):
            lost.append(rounds)
        await js.delete_consumer(stream, durable)
    assert not lost, f"delivered but not handed back in rounds {lost} of 30"


async def test_an_idle_source_closes_without_waiting_out_its_heartbeats(
    conn: Connection, js: JetStreamContext, stream: str
) -> None:
    """A request given up on with nothing to send would end only at its expiry: close
    does not wait two heartbeats for it (10 s here, as it did) but unsubscribes once the
    request is quiet, and the server then serves it nothing more."""
    subject = f"{stream.lower()}.idle"
    await js.add_consumer(stream, durable_name="idle", ack_policy="explicit", ack_wait=60,
                          deliver_policy="new")  # fmt: skip
    source = PullSource(conn.nc, stream, "idle", expires=30.0, heartbeat=5.0)
    await source.start()
    stopping = asyncio.Event()
    stopping.set()
    assert (await source.fetch(4, stopping)).messages == []
    started = time.monotonic()
    assert await source.close() == []
    took = time.monotonic() - started
    assert took < 2.0, f"close took {took:.1f}s; two heartbeats are 10 s"  # 0.1 s quiet, 20x
    # The request given up on takes nothing published after the close: the next source
    # gets the message on its first delivery, not after a 60 s ack wait.
    await js.publish(subject, b"after")
    after = PullSource(conn.nc, stream, "idle")
    await after.start()
    got: list[Msg] = []
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got = (await after.fetch(1)).messages
    await after.close()
    assert [(m.data, m.metadata.num_delivered) for m in got] == [(b"after", 1)]
