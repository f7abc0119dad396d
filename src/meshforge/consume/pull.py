"""Pull requests sized to free capacity, with heartbeats that reveal a dead request.

``PullSource`` sends one JetStream pull request at a time for at most ``n`` messages (the
caller's free capacity), so the server never marks more messages delivered than the
worker can start at once: nothing waits in a local buffer while its ack timer runs. A
request waits up to ``expires`` for the first message and returns as soon as no more are
available (``no_wait`` with ``expires``). The server sends an idle heartbeat every
``heartbeat`` seconds while a request waits; silence for two of them means the request
died (a killed and restarted server forgets its waiting requests, the classic stall of
plain pull subscriptions), and the caller is told so it can ask again or ``rebuild``.

Example::

    source = PullSource(conn.nc, "MESHFORGE_COMMANDS", "order_consumer")
    await source.start()
    result = await source.fetch(8)
    for msg in result.messages:
        ...
    leftovers = await source.close()     # delivered but not handed out: nak them
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from meshforge.ops.faults import crash_point
from meshforge.transport.headers import server_status

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

__all__ = ["FetchResult", "Owner", "Pause", "PullLoop", "PullSource"]

log = logging.getLogger("meshforge.consumer")

Outcome = Literal["messages", "empty", "silent", "error", "stopped"]

_DESCRIPTION = "Description"
_PIN = "Nats-Pin-Id"
_HEARTBEAT = "100"
FENCED = "423"  # the pin this client sent was revoked: another client owns the consumer now
_END = {"404", "408"}  # no messages / request expired: the server is alive and idle
_MISSED_HEARTBEATS = 2
_SLACK = 0.5
# A request given up on at a stop is over once nothing has come for this long: the server
# sends what it has at once, and after the unsubscribe it hands a request without interest
# nothing more (it checks for a subscriber before each one it serves).
_CLOSE_QUIET = 0.1
_IDLE_MIN, _IDLE_MAX = 0.05, 1.0
_SILENT_REBUILD = 2  # silent requests in a row before the subscription is rebuilt
_STALL_CHECK = 10.0  # seconds of empty fetches between checks of the pending count
_DRAIN_TIMEOUT = 2.0  # seconds for the server to confirm an unsubscribe


@dataclass(slots=True)
class FetchResult:
    """What one pull request brought: messages, or why there were none.

    ``outcome``: ``messages``; ``empty`` (the server answered: nothing to deliver);
    ``silent`` (no heartbeat nor answer: the request is gone); ``error`` (a status such as
    409 Consumer Deleted, or the connection refused the request; see ``detail``);
    ``stopped`` (``stop`` was set while waiting). ``surplus``: messages delivered for an
    earlier, abandoned request beyond ``n``; the caller naks them.
    """

    outcome: Outcome
    messages: list[Msg] = field(default_factory=list)
    detail: str = ""
    status: str | None = None
    surplus: list[Msg] = field(default_factory=list)


class _Mailbox:
    """The messages the connection handed over, oldest first, and the one fetch waiting
    for them (a deque and a future: an ``asyncio.Queue`` costs more per message)."""

    __slots__ = ("_waiter", "items")

    def __init__(self) -> None:
        self.items: deque[Msg | None] = deque()  # None: a stop wake-up
        self._waiter: asyncio.Future[None] | None = None

    def put(self, msg: Msg | None) -> None:
        self.items.append(msg)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, seconds: float) -> bool:
        """Until something is put (True) or ``seconds`` passed (False)."""
        if self.items:
            return True
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(seconds):
                await self._waiter
        except TimeoutError:
            return False
        finally:
            self._waiter = None
        return True


class PullSource:
    """One durable pull consumer's request/response channel on a private inbox."""

    def __init__(
        self,
        nc: NATS,
        stream: str,
        durable: str,
        *,
        expires: float = 5.0,
        heartbeat: float = 1.0,
        group: str | None = None,
    ) -> None:
        if heartbeat * 2 > expires:
            raise ValueError("pull heartbeat must be at most half of expires")
        self._nc = nc
        self.stream = stream
        self.durable = durable
        # A consumer with a pinned_client priority group: requests name the group and, once
        # the server pinned us (the Nats-Pin-Id of what it delivers), the pin.
        self.group = group
        self.pin: str | None = None
        self.expires = expires
        self.heartbeat = heartbeat
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._box = _Mailbox()
        self._watching: asyncio.Event | None = None
        self._watcher: asyncio.Future[None] | None = None
        self._sub: Subscription | None = None
        self._prefix = ""
        self._requests = 0
        # The last request while the server may still answer it (a fetch gave up on it):
        # its reply subject and how many messages it may still bring.
        self._open: tuple[str, int] | None = None
        # The connection's reconnect count when the last request was sent: a request
        # waiting on a connection that was lost since is gone with it (a restarted server
        # forgets it), found at once instead of after two silent heartbeats.
        self._sent_on = 0
        self.rebuilds = 0

    async def start(self) -> None:
        """Subscribe the private inbox (a fresh one each time)."""
        self._prefix = self._nc.new_inbox()
        box = self._box

        async def on_message(msg: Msg) -> None:
            box.put(msg)

        self._sub = await self._nc.subscribe(f"{self._prefix}.*", cb=on_message)
        direct = getattr(self._nc, "deliver_direct", None)
        if direct is not None:  # a MeshForge connection: straight into the mailbox
            direct(self._sub._id, box.put)

    async def fetch(self, n: int, stop: asyncio.Event | None = None) -> FetchResult:
        """Ask for up to ``n`` messages; return when they came, the server said there are
        no more, the request went silent, or ``stop`` was set.

        Messages delivered for an earlier request the caller gave up on (rare: after a
        silent or stopped request) are returned first, without a new request.
        """
        if self._sub is None:
            raise RuntimeError("PullSource.start() was not called")
        stray = self._drain_local()
        if stray:
            # Already delivered to us: hand them out now, at most n.
            if self.group is not None:
                self._take_pin(stray)
            return FetchResult("messages", stray[:n], detail="stray", surplus=stray[n:])
        self._watch(stop)
        self._requests += 1
        reply = f"{self._prefix}.{self._requests}"
        body: dict[str, object] = {
            "batch": n,
            "expires": int(self.expires * 1e9),
            "no_wait": True,
            "idle_heartbeat": int(self.heartbeat * 1e9),
        }
        if self.group is not None:
            body["group"] = self.group
            if self.pin is not None:
                body["id"] = self.pin
        self._sent_on = self._reconnects()
        try:
            await self._nc.publish(self._api, json.dumps(body).encode(), reply=reply)
        except Exception as exc:  # closed/draining connection: the caller backs off
            return FetchResult(
                "error", detail=f"pull request not sent: {type(exc).__name__}: {exc}"
            )
        self._open = (reply, n)
        return await self._collect(reply, n, stop)

    async def _collect(
        self,
        reply: str,
        n: int,
        stop: asyncio.Event | None,
        *,
        within: float | None = None,
        quiet: float | None = None,
    ) -> FetchResult:
        """The answer to request ``reply``, for ``within`` seconds at most (default: its
        ``expires`` and some slack); silent after ``quiet`` seconds without a message or
        status (default: two heartbeats and some slack)."""
        silence = self.heartbeat * _MISSED_HEARTBEATS + _SLACK if quiet is None else quiet
        got: list[Msg] = []
        items = self._box.items
        start = last = time.monotonic()
        deadline = start + (self.expires + _SLACK if within is None else within)
        heard = False  # something came since ``last`` was taken
        while len(got) < n:
            if not items:
                now = time.monotonic()
                if heard:  # the messages just taken came a moment ago
                    last, heard = now, False
                quiet_until = last + silence
                wait = min(deadline, quiet_until) - now
                if wait <= 0:
                    if got:
                        break
                    self._open = None  # gone silent: the server forgot it, or is away
                    return FetchResult("silent", detail=f"no answer for {now - last:.1f}s")
                if not await self._box.wait(wait):
                    if stop is not None and stop.is_set():
                        return self._gave_up(reply, n, got)
                    continue
            msg = items.popleft()
            if msg is None:  # a wake-up: stop set, or the connection came back
                if stop is not None and stop.is_set():
                    return self._gave_up(reply, n, got)
                if self._reconnects() != self._sent_on:
                    self._open = None
                    if got:
                        break
                    return FetchResult("silent", detail="the connection was lost since the request")
                continue
            status = server_status(msg)
            if not status:
                got.append(msg)
                heard = True
                continue
            if msg.subject != reply:
                continue  # a late status for a request we already gave up on
            heard = True
            if status == _HEARTBEAT:
                continue
            description = (msg.headers or {}).get(_DESCRIPTION, "")
            self._open = None  # a status other than a heartbeat ends the request
            if status in _END:
                break
            if got:
                break
            return FetchResult("error", detail=f"{status} {description}".strip(), status=status)
        if len(got) == n:
            self._open = None
        if got and self.group is not None:
            self._take_pin(got)
        return FetchResult("messages" if got else "empty", got)

    def _reconnects(self) -> int:
        return int(self._nc.stats["reconnects"])

    def _gave_up(self, reply: str, n: int, got: list[Msg]) -> FetchResult:
        self._open = (reply, n - len(got))
        return FetchResult("stopped", got)

    async def _await_open_request(self) -> list[Msg]:
        """The messages of a request given up on, while they keep coming: until the server
        ends it (a status, or as many as it asked for) or goes quiet for ``_CLOSE_QUIET``,
        twice ``heartbeat`` at most. Messages already on their way are taken here or by the
        drain that follows, not dropped at an inbox no one listens to (each would stay
        unacknowledged until its ack wait ran out); an idle request costs no wait."""
        if self._open is None:
            return []
        reply, remaining = self._open
        within = self.heartbeat * _MISSED_HEARTBEATS  # no end by then: the unsubscribe ends it
        found = await self._collect(reply, remaining, None, within=within, quiet=_CLOSE_QUIET)
        return found.messages

    def _take_pin(self, msgs: list[Msg]) -> None:
        """The pin the server gave us, from the last message (one request, one pin)."""
        pin = (msgs[-1].headers or {}).get(_PIN)
        if pin and pin != self.pin:
            if self.pin is not None:
                log.info("pull %s: pinned again (%s)", self.durable, pin)
            self.pin = pin

    def _watch(self, stop: asyncio.Event | None) -> None:
        """Wake a waiting fetch when ``stop`` is set: one task per event, not per fetch."""
        if stop is None or (
            self._watching is stop and self._watcher is not None and not self._watcher.done()
        ):
            return
        if self._watcher is not None:
            self._watcher.cancel()
        self._watching = stop
        box = self._box

        async def watch() -> None:
            await stop.wait()
            box.put(None)

        self._watcher = asyncio.ensure_future(watch())

    def _drain_local(self) -> list[Msg]:
        """Data messages waiting locally; stale statuses are dropped."""
        messages: list[Msg] = []
        items = self._box.items
        while items:
            msg = items.popleft()
            if msg is not None and not server_status(msg):
                messages.append(msg)
        return messages

    async def rebuild(self) -> list[Msg]:
        """Drop the inbox and subscribe a fresh one; returns messages left behind."""
        leftovers = await self._unsubscribe(drain=False)  # the server went quiet: no waiting on it
        await self.start()
        self.rebuilds += 1
        return leftovers

    async def close(self) -> list[Msg]:
        """Unsubscribe (the server drops a waiting request with no interest); returns
        messages delivered but not handed out, which the caller must nak."""
        return await self._unsubscribe(drain=True)

    async def _unsubscribe(self, *, drain: bool) -> list[Msg]:
        """Unsubscribe; ``drain``: first let a request given up on end, then unsubscribe
        and wait for the server's answer to a ping, still taking what arrives. The server
        may answer a request until it ends; a message sent to an inbox no one listens to
        any more is dropped and stays unacknowledged, out of everyone's hands, until its
        ack wait runs out (a partition's next owner would apply later commands first)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = self._watching = None
        # Only a connected client can still be sent anything.
        came = (
            await self._await_open_request()
            if drain and self._sub is not None and self._nc.is_connected
            else []
        )
        sub, self._sub = self._sub, None
        if sub is not None and drain:
            try:
                async with asyncio.timeout(_DRAIN_TIMEOUT):
                    await sub.drain()  # type: ignore[no-untyped-call]
            except Exception:  # closed or unreachable: nothing more can arrive
                self._nc._remove_sub(sub._id)  # a drain cut short leaves it registered
        elif sub is not None:
            with contextlib.suppress(Exception):  # a closed connection has no interest left
                await sub.unsubscribe()
        self._open = None
        return came + self._drain_local()


class Pause(Protocol):
    """Something that may hold fetching back (the worker's kill switch)."""

    @property
    def paused(self) -> bool: ...

    async def resumed(self) -> None: ...


class Owner(Protocol):
    """What a pull loop asks about the ownership of its durable (``Tenure``)."""

    def take_back(self) -> int: ...

    async def unpinned_idle(self, pinned: Callable[[], bool]) -> None: ...

    async def refused(self) -> None: ...


class PullLoop:
    """Fetch for free capacity, dispatch, back off when idle, and recover from stalls.

    Between empty fetches it waits 0.05 s doubling to 1 s (a fetch with messages resets
    it; a long poll that already waited counts toward it). Two silent requests in a row,
    a 409 "consumer deleted", or ``_STALL_CHECK`` seconds of empty fetches while the
    server reports pending messages (seen twice, with an empty fetch between) make it
    rebuild: a fresh inbox, and ``recover()`` (which provisions the consumer again when
    allowed). A request sent before the connection was lost ends as silent at the
    reconnect (``Connection`` wakes every direct subscriber), not two heartbeats later.

    With ``gather`` (seconds; batch consumers), a fetch that got fewer messages than it
    asked for (the server had no more: a steady load, not a backlog) is followed by a wait
    until nothing is in flight, ``gather`` at most, before the next fetch. Messages that
    arrive meanwhile would wait behind the work in flight anyway; taken together they are
    one pull request and one batch instead of one for every message or two. No wait when
    nothing is in flight (a light load's message is fetched at once) or when fetches come
    back full (a backlog).

    On a consumer with a pinned_client priority group the loop asks its ``owner`` (a
    ``meshforge.topology.ownership.Tenure``): a 423 (our pin was revoked: another client
    was given the consumer) ends the loop at once after ``owner.refused()``; an empty fetch
    while not pinned calls ``owner.unpinned_idle()`` (which may find another client pinned
    and take the consumer over again); and before each fetch ``owner.take_back()`` says how
    many redeliveries to take back first, handed over as one batch in stream order.
    """

    def __init__(
        self,
        source: PullSource,
        *,
        stop: asyncio.Event,
        batch_size: int,
        wait_free: Callable[[int], Awaitable[bool]],
        in_flight: Callable[[], int],
        limit: int,
        dispatch: Callable[[list[Msg]], None],
        nak: Callable[[Msg], Awaitable[None]],
        recover: Callable[[], Awaitable[None]],
        pending: Callable[[], Awaitable[int | None]],
        closed: Callable[[], bool],
        owner: Owner | None = None,
        gather: float = 0.0,
        pause: Pause | None = None,
        reserve: Callable[[int], None] | None = None,
    ) -> None:
        self.source = source
        self._reserve = reserve or (lambda n: None)
        # Room shared with other consumers (``reserve``): a pull the server cannot fill at
        # once waits up to ``expires`` for its first message with its room reserved, so
        # only a fetch after a full one (a backlog) asks for more than one message.
        self._shared = reserve is not None
        self._pause = pause
        self._gather = gather
        self._stop = stop
        self._batch_size = batch_size
        self._wait_free = wait_free
        self._in_flight = in_flight
        self._limit = limit
        self._dispatch = dispatch
        self._nak = nak
        self._recover = recover
        self._pending = pending
        self._closed = closed
        self._owner = owner

    async def run(self) -> None:
        """Until ``stop`` is set; raises ``ConnectionError`` if the connection closes for good."""
        idle, silent = _IDLE_MIN, 0
        idle_since: float | None = None
        suspect = False  # the last check found messages pending: one more fetch, then look again
        last_check = time.monotonic()
        owner = self._owner
        full = not self._shared  # the last fetch came back full
        while await self._wait_free(self._limit):
            if self._pause is not None and self._pause.paused:
                await self._paused()
                continue
            if owner is not None and (due := owner.take_back()):
                await self._take_back(due)
                continue
            n = min(self._batch_size, self._limit - self._in_flight()) if full else 1
            started = time.monotonic()
            self._reserve(n)  # the room is this fetch's until its messages are held
            try:
                result = await self.source.fetch(n, self._stop)
                for msg in result.surplus:
                    await self._nak(msg)
                if result.messages:
                    crash_point("after_fetch")
                    self._dispatch(result.messages)
            finally:
                self._reserve(-n)
            full = not self._shared or len(result.messages) == n
            if result.messages:
                idle, silent, idle_since, suspect = _IDLE_MIN, 0, None, False
                if self._gather > 0 and len(result.messages) < n:
                    await self._gather_arrivals()
                continue
            if result.outcome == "stopped":
                return
            if self._closed():
                raise ConnectionError("the NATS connection is closed")
            if result.outcome == "silent":
                silent += 1
                if silent >= _SILENT_REBUILD:
                    await self.rebuild(f"{silent} pull requests in a row went unanswered")
                    silent = 0
            elif result.outcome == "error":
                if result.status == FENCED and owner is not None:
                    log.warning("pull %s: %s: another worker owns it now; fetching no more of it",
                                self.source.durable, result.detail)  # fmt: skip
                    await owner.refused()
                    return
                log.warning("pull %s: %s", self.source.durable, result.detail)
                if result.status == "409" and "deleted" in result.detail.lower():
                    await self.rebuild(result.detail)
            else:
                silent = 0
                if owner is not None and self.source.pin is None:
                    await owner.unpinned_idle(self._pinned)
                idle_since = idle_since or started
                if suspect or time.monotonic() - max(idle_since, last_check) >= _STALL_CHECK:
                    last_check = time.monotonic()
                    pending = await self._pending()
                    # A message stored just after the server ended an empty request is
                    # pending too: only a second empty fetch after seeing it is a stall.
                    if pending and suspect:
                        await self.rebuild(f"{pending} messages pending but fetches return none")
                    suspect = bool(pending) and not suspect
            await self._sleep(idle - (time.monotonic() - started))
            idle = min(idle * 2, _IDLE_MAX)

    def _pinned(self) -> bool:
        return self.source.pin is not None

    async def _take_back(self, due: int) -> None:
        """Redeliveries of what a previous owner held come back in the order their ack
        waits ran out, which its ``in_progress`` beats can have made differ from the order
        they were stored. Take ``due`` of them back (as many as there is room for) before
        handing any over, and hand them over as one batch in stream order."""
        limit = min(due, self._limit - self._in_flight())
        got: list[Msg] = []
        self._reserve(limit)
        try:
            while len(got) < limit and not self._stop.is_set():
                result = await self.source.fetch(
                    min(self._batch_size, limit - len(got)), self._stop
                )
                got += result.messages
                for msg in result.surplus:
                    await self._nak(msg)
                if result.outcome != "messages" or any(
                    m.metadata.num_delivered == 1 for m in result.messages
                ):
                    break  # nothing more is due, or a new command: every redelivery came first
            if got:
                log.info(
                    "consumer %s: took back %d of %d held by the previous owner",
                    self.source.durable,
                    len(got),
                    due,
                )
                self._dispatch(sorted(got, key=lambda m: m.metadata.sequence.stream))
        finally:
            self._reserve(-limit)

    async def _paused(self) -> None:
        """Fetch nothing while an outage holds the work (what is held is kept alive)."""
        resumed = asyncio.ensure_future(self._pause.resumed()) if self._pause is not None else None
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait(
                {f for f in (resumed, stopped) if f is not None},
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for future in (resumed, stopped):
                if future is not None:
                    future.cancel()

    async def _gather_arrivals(self) -> None:
        """After a fetch that emptied the server's queue: let what arrives while work is
        in flight gather at the server, until nothing is in flight or ``gather`` seconds
        pass, and take it in one fetch then, not in many small ones."""
        if self._in_flight() == 0:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._gather):  # no task of its own, as wait_for has
                await self._wait_free(1)

    async def rebuild(self, why: str) -> None:
        """A fresh inbox; messages left in the old one are nak'ed; then ``recover()``."""
        log.warning("consumer %s: %s; rebuilding the pull subscription", self.source.durable, why)
        for msg in await self.source.rebuild():
            await self._nak(msg)
        await self._recover()

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), seconds)
