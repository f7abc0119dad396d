"""The processes the agent benchmarks measure, each run as its own OS process.

- ``EchoAgent``: a MeshForge agent (``meshforge run _variants:EchoAgent``): one event out
  per command, keyed by the command's ``id`` (exactly once, SQLite store).
- ``CheckedEchoAgent`` and ``TypedEchoAgent``: the same agent checking its payload, by hand
  on the dict or by declaring it as ``Work`` (``bench_typed.py`` compares the two).
- ``raw``: the strongest plain nats-py loop: ``LANES`` pull lanes on one durable, each
  ``fetch(256)``, decode, build the output, ``publish_async`` each, wait for the
  PubAcks, ack each; while one lane waits for its PubAcks the other fetches. No store.
- ``raw-serial``: the same with one lane (it never fetches while it waits for PubAcks).
- ``fs``: FastStream as its documentation shows it: a per-message handler on
  ``PullSub(batch_size=256)`` returning its output to a broker publisher; FastStream
  runs the handlers of a fetched batch concurrently.
- ``fs-workers``: the same with ``max_workers=FS_WORKERS`` (a queue and that many worker tasks).
- ``load``: an open-loop generator: command i is due at start + i / rate and carries
  that time (the monotonic clock, shared by every process of the machine), not the time
  it actually left: a late generator must not hide the wait (coordinated omission).
  At the end it prints its lag behind the schedule as one ``@lag`` JSON line.

    python benchmarks/_variants.py raw NATS_URL IN_SUBJECT OUT_SUBJECT
    python benchmarks/_variants.py fs-workers NATS_URL IN_SUBJECT OUT_SUBJECT
    python benchmarks/_variants.py load NATS_URL SUBJECT RATE SECONDS
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Annotated, Any

import msgspec
import nats
from nats.errors import TimeoutError as NatsTimeout

from meshforge.envelope import Envelope
from meshforge.errors import Unrecoverable
from meshforge.runtime import Agent, Command, Event, Output, command

FETCH = 256
LANES = 2
# FastStream's worker tasks with max_workers: worker CPU a command on 8,000-command backlogs
# with 8, 16, 32, 64, 256 of them: 297, 248, 290, 310, 430 us (16 the fastest too).
FS_WORKERS = 16
LAG_TAG = "@lag "
STREAM_IN = "BENCH_IN"
STREAM_OUT = "BENCH_OUT"
DURABLE = "bench"


class Echo(msgspec.Struct):
    """What the agent keeps per command id: how many it saw."""

    seen: int = 0


class EchoAgent(Agent[Echo]):
    """``work {"id", "blob", "t"?}`` emits ``worked {"id", "n", "t"}``."""

    name = "echo"

    @command("work", key="id")
    def work(self, cmd: Envelope, state: Echo) -> list[Output]:
        p = cmd.payload
        return [Event("worked", {"id": p["id"], "n": len(p["blob"]), "t": p.get("t", 0)})]

    def apply(self, state: Echo, event: Event) -> Echo:
        return Echo(seen=state.seen + 1)


class Work(msgspec.Struct, frozen=True):
    """``echo.work``'s payload as a declared type: what ``CheckedEchoAgent`` checks by hand."""

    id: Annotated[str, msgspec.Meta(min_length=1)]
    blob: str
    t: float = 0.0


class CheckedEchoAgent(Agent[Echo]):
    """``EchoAgent`` with its payload checked by hand, as a dict handler must: the same
    checks ``Work`` declares, the same errors (unrecoverable), the same output."""

    name = "echo"

    @command("work", key="id")
    def work(self, cmd: Envelope, state: Echo) -> list[Output]:
        p = cmd.payload
        id_, blob, t = p.get("id"), p.get("blob"), p.get("t", 0.0)
        if not isinstance(id_, str) or not id_:
            raise Unrecoverable(
                f"invalid echo.work payload: 'id' must be a non-empty string, got {id_!r}"
            )
        if not isinstance(blob, str):
            raise Unrecoverable(f"invalid echo.work payload: 'blob' must be a string, got {blob!r}")
        if isinstance(t, bool) or not isinstance(t, int | float):
            raise Unrecoverable(f"invalid echo.work payload: 't' must be a number, got {t!r}")
        return [Event("worked", {"id": id_, "n": len(blob), "t": t})]

    def apply(self, state: Echo, event: Event) -> Echo:
        return Echo(seen=state.seen + 1)


class TypedEchoAgent(Agent[Echo]):
    """``EchoAgent`` with its payload declared: decoded and checked before the handler."""

    name = "echo"

    @command("work", key="id")
    def work(self, cmd: Command[Work], state: Echo) -> list[Output]:
        p = cmd.payload
        return [Event("worked", {"id": p.id, "n": len(p.blob), "t": p.t})]

    def apply(self, state: Echo, event: Event) -> Echo:
        return Echo(seen=state.seen + 1)


def output_of(body: bytes) -> bytes:
    """The baselines' handler: the same work the agent's handler does."""
    cmd = json.loads(body)
    p = cmd["payload"]
    return json.dumps({"id": p["id"], "n": len(p["blob"]), "t": p.get("t", 0)}).encode()


async def raw(url: str, out_subject: str, lanes: int = LANES) -> None:
    """``lanes`` loops on one durable: one fetches while another waits for its PubAcks."""
    nc = await nats.connect(url)
    js = nc.jetstream(publish_async_max_pending=FETCH * lanes)

    async def lane() -> None:
        sub = await js.pull_subscribe_bind(durable=DURABLE, stream=STREAM_IN)
        while True:
            try:
                msgs = await sub.fetch(FETCH, timeout=5)
            except NatsTimeout:
                continue
            acks = [await js.publish_async(out_subject, output_of(m.data)) for m in msgs]
            await asyncio.gather(*acks)
            for m in msgs:
                await m.ack()

    await asyncio.gather(*(lane() for _ in range(lanes)))


async def faststream(url: str, in_subject: str, out_subject: str, style: str) -> None:
    """FastStream on its own broker: ``per-message`` (as documented) or with ``workers``."""
    from faststream.nats import JStream, NatsBroker, PullSub

    broker = NatsBroker(url, logger=None)
    stream = JStream(STREAM_IN, declare=False)
    workers = {"max_workers": FS_WORKERS} if style == "workers" else {}

    @broker.subscriber(
        in_subject, stream=stream, durable=DURABLE, pull_sub=PullSub(batch_size=FETCH), **workers
    )
    @broker.publisher(out_subject, stream=STREAM_OUT)
    async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        p = cmd["payload"]
        return {"id": p["id"], "n": len(p["blob"]), "t": p.get("t", 0)}

    await broker.start()
    await asyncio.Event().wait()


def command_body(blob: str, sent: float = 0.0) -> Envelope:
    return Envelope.new("echo.work", {"id": uuid.uuid4().hex, "blob": blob, "t": sent})


# A stamp no clock reading will be: the generator puts the send time in its place.
_STAMP = 987654.125


async def load(url: str, subject: str, rate: float, seconds: float, blob: str) -> None:
    """Open loop: command i is due at start + i / rate, whether or not earlier ones are done,
    and carries that due time: its latency counts from the schedule, not from when it left.

    The commands are built before the clock starts and sent as plain NATS publishes (the
    stream stores them all the same; the benchmark counts the outputs): the generator
    shares the machine with what it measures, and building an envelope, a timer per
    command and a PubAck each cost it a third of a core at 1,000 a second."""
    from meshforge.envelope import Outbound

    nc = await nats.connect(url)
    total = int(rate * seconds)
    mark = repr(_STAMP).encode()
    ready = []
    for _ in range(total):
        item = Outbound.of(subject, command_body(blob, _STAMP))
        head, tail = item.data.split(mark)
        ready.append((head, tail, dict(item.headers)))
    publish, clock = nc.publish, time.monotonic
    lags = []
    start = clock() + 0.05
    for i, (head, tail, headers) in enumerate(ready):
        due = start + i / rate
        wait = due - clock()
        if wait > 0:
            await asyncio.sleep(wait)
        lags.append(clock() - due)
        await publish(subject, head + repr(due).encode() + tail, headers=headers)
    await nc.flush()
    await nc.close()
    lags.sort()
    pick = lags.__getitem__
    print(
        LAG_TAG
        + json.dumps(
            {"p50": pick(len(lags) // 2), "p99": pick(int(0.99 * len(lags))), "max": lags[-1]}
        ),
        flush=True,
    )


if __name__ == "__main__":
    kind, url, *rest = sys.argv[1:]
    if kind in ("raw", "raw-serial"):
        asyncio.run(raw(url, rest[1], LANES if kind == "raw" else 1))
    elif kind.startswith("fs"):
        asyncio.run(
            faststream(
                url, rest[0], rest[1], {"fs": "per-message"}.get(kind, kind.removeprefix("fs-"))
            )
        )
    elif kind == "load":
        asyncio.run(load(url, rest[0], float(rest[1]), float(rest[2]), "x" * int(rest[3])))
    else:
        raise SystemExit(f"unknown variant {kind!r}")
