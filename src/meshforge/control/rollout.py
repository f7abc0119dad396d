"""The job controller: sends a job's command to its nodes at the job's rate and follows
their replies, with every step written to the jobs bucket first or re-derivable after.

One controller drives a job at a time (a lease in the bucket, renewed as it goes; a
second one waits for it). A controller killed at any point and started again (once its
lease has expired, within seconds) reads the bucket, reads the replies
since the job was created (so an answer that came while it was down is not missed) and
goes on; a command it sent but did not record is sent again with the same id, which the
server's duplicate window (or, later, the node's reply log) keeps from running twice.

The bucket is read once, when the controller starts: from then on the job's state lives
in a ``Ledger`` in memory, and every change is written through to the bucket. A send, a
reply and a timeout each cost the controller the same few steps however many nodes the
job has (a cursor over the targets, counts by state, the attempts in send order), so a
rollout to 10,000 nodes goes at the asked rate as one to ten does.

Example::

    store = await JobStore.open(conn.js)
    await store.create(JobSpec("fw-7", "echo", {}, targets=[("plant3", "valve12")], rate=60))
    final = await JobController(conn, store, "fw-7").run()   # "completed", "aborted", ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from meshforge.control.client import ControlClient
from meshforge.control.jobs import (
    FAILED_STATES,
    NODE_STATES,
    TERMINAL,
    JobSpec,
    JobStore,
    NodeJob,
    NodeState,
    attempt_id,
)
from meshforge.control.reply import Reply
from meshforge.envelope import H_CAUSATION, decode, now_ts
from meshforge.errors import MalformedMessage, MeshForgeError, PublishError
from meshforge.ops.faults import crash_point
from meshforge.ops.observability import Metrics
from meshforge.topology.subjects import STREAM_REPLIES
from meshforge.transport.connection import Connection
from meshforge.transport.headers import text_headers

__all__ = ["JobController", "Ledger", "Pacer", "WriteThrough", "figures", "summarize"]

log = logging.getLogger("meshforge.control.jobs")

_FROM_REPLY: dict[str, NodeState] = {
    "ok": "SUCCEEDED",
    "error": "FAILED",
    "expired": "EXPIRED",
    "rejected": "REJECTED",
    "canceled": "CANCELED",
}
# Replies are read from a little before the job was created: clock skew hides none.
_LOOKBACK = timedelta(seconds=5)
# How late a send may be and still be made up by sending the next ones sooner (Pacer):
# rate/500 seconds (a fifth of a second at 100/s, one at 500/s), at least 50 ms.
_CATCH_UP_MIN, _CATCH_UP_MAX = 0.05, 1.0
# The most commands sent in one batch (their PubAcks awaited together).
_BATCH = 256


def _ts(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def summarize(records: Mapping[str, NodeJob]) -> dict[str, int]:
    """How many nodes are in each state (every state named, zeros included)."""
    return _named(Counter(r.state for r in records.values()))


def _named(counts: Mapping[str, int]) -> dict[str, int]:
    return {state: counts.get(state, 0) for state in NODE_STATES}


def figures(records: Mapping[str, NodeJob], now: datetime | None = None) -> dict[str, Any]:
    """Counts by state, the failed share of the nodes done (canceled ones aside) and the
    oldest command in progress (when it was sent, and its age in seconds)."""
    sent = [r.sent_at for r in records.values() if r.state == "IN_PROGRESS" and r.sent_at]
    return _figures(summarize(records), min(sent) if sent else None, now)


def _figures(counts: dict[str, int], oldest: str | None, now: datetime | None) -> dict[str, Any]:
    done = sum(n for s, n in counts.items() if s in TERMINAL and s != "CANCELED")
    failed = sum(counts[s] for s in FAILED_STATES)
    age = ((now or datetime.now(UTC)) - _ts(oldest)).total_seconds() if oldest else 0.0
    return {
        "counts": counts,
        "failed_share": round(failed / done, 4) if done else 0.0,
        "oldest_in_progress": oldest,
        "oldest_in_progress_seconds": round(max(age, 0.0), 3),
    }


class Ledger:
    """A job's node records in memory, answering what the controller asks at every step in
    constant time: the next node to send, the counts by state, the attempts overdue.

    Built once from the bucket's records (a target without one is ``QUEUED``), then changed
    only by ``put``. The next node to send comes from a cursor over the targets, in their
    order, after any node put back to ``QUEUED`` (a retry); each target passes the cursor
    once. The attempts in progress are kept in the order they were sent, which is the order
    their timeouts fall due.

        ledger = Ledger(spec.targets, await store.nodes(job))
        record = ledger.next_queued()        # None once nothing waits to be sent
    """

    def __init__(self, targets: Sequence[tuple[str, str]], records: Mapping[str, NodeJob]) -> None:
        self.records: dict[str, NodeJob] = {}
        for site, node in targets:
            key = f"{site}.{node}"
            self.records[key] = records.get(key) or NodeJob(site, node)
        self._counts: Counter[str] = Counter(r.state for r in self.records.values())
        self._order = list(self.records)
        self._cursor = 0
        self._again: deque[str] = deque()
        sent = [r for r in self.records.values() if r.state == "IN_PROGRESS" and r.sent_at]
        sent.sort(key=lambda r: str(r.sent_at))
        self._flight: deque[tuple[str, str, int]] = deque(
            (str(r.sent_at), r.key, r.attempt) for r in sent
        )

    def put(self, record: NodeJob) -> None:
        """Take ``record`` as its node's state now."""
        old = self.records[record.key]
        self.records[record.key] = record
        self._counts[old.state] -= 1
        self._counts[record.state] += 1
        if record.state == "QUEUED" and old.state != "QUEUED":
            self._again.append(record.key)
        new_attempt = old.state != "IN_PROGRESS" or old.attempt != record.attempt
        if record.state == "IN_PROGRESS" and record.sent_at and new_attempt:
            self._flight.append((record.sent_at, record.key, record.attempt))

    def again(self, record: NodeJob) -> None:
        """Give ``record`` (still ``QUEUED``: taken, but not sent) out again, before the rest."""
        self._again.append(record.key)

    def next_queued(self) -> NodeJob | None:
        """The next node waiting to be sent (the caller sends it now), or None."""
        while self._again:
            record = self.records[self._again.popleft()]
            if record.state == "QUEUED":
                return record
        while self._cursor < len(self._order):
            record = self.records[self._order[self._cursor]]
            self._cursor += 1
            if record.state == "QUEUED":
                return record
        return None

    def count(self, *states: str) -> int:
        return sum(self._counts[s] for s in states)

    @property
    def finished(self) -> bool:
        """Every node in a terminal state."""
        return self.count("QUEUED", "IN_PROGRESS") == 0

    def done_and_failed(self) -> tuple[int, int]:
        """The nodes done (canceled ones aside) and, of them, the failed."""
        done = self.count(*(TERMINAL - {"CANCELED"}))
        return done, self.count(*FAILED_STATES)

    def in_state(self, *states: NodeState) -> list[NodeJob]:
        """Every node in one of ``states``: a pass over all, for the once-only verdicts."""
        return [r for r in self.records.values() if r.state in states]

    def overdue(self, now: datetime, timeout: float) -> Iterator[NodeJob]:
        """The attempts in progress sent more than ``timeout`` s before ``now``, oldest first
        (each given once: the caller judges it)."""
        while (head := self._head()) is not None:
            if (now - _ts(head[0])).total_seconds() <= timeout:
                return
            self._flight.popleft()
            yield self.records[head[1]]

    def oldest_in_progress(self) -> str | None:
        """When the oldest attempt still in progress was sent."""
        head = self._head()
        return head[0] if head else None

    def _head(self) -> tuple[str, str, int] | None:
        # Attempts answered or judged since they were sent leave the queue as they reach its head.
        while self._flight:
            _, key, attempt = self._flight[0]
            record = self.records[key]
            if record.state == "IN_PROGRESS" and record.attempt == attempt:
                return self._flight[0]
            self._flight.popleft()
        return None

    def figures(self, now: datetime | None = None) -> dict[str, Any]:
        """What ``figures`` gives for these records, without a pass over them."""
        return _figures(_named(self._counts), self.oldest_in_progress(), now)


class Pacer:
    """How many commands of a job may go now, at ``per_minute`` (None: all at once).

    The sends keep to a fixed schedule, one slot a command; the slots passed since the
    last call go together (a batch, sent pipelined). Slots missed by up to ``catch_up`` s
    are made up that way: a wake-up a few milliseconds late, or a batch whose PubAcks
    took a while, at 500 commands/s would otherwise cost a third of the rate. A longer
    stall is not made up, so no burst follows it. ``catch_up`` is the rate over 500 in
    seconds (0.2 s at 100/s, 1 s at 500/s and more), at least 50 ms: at 25 commands/s
    or slower two sends are never closer than the gap less 50 ms.

        pacer = Pacer(6000)                   # 100 a second
        n = pacer.take(time.monotonic(), most=queued)   # send n now
        await asyncio.sleep(pacer.wait(time.monotonic()))
    """

    def __init__(self, per_minute: float | None, catch_up: float | None = None) -> None:
        self.gap = 60.0 / per_minute if per_minute else 0.0
        if catch_up is None:
            per_second = 1.0 / self.gap if self.gap else 0.0
            catch_up = min(_CATCH_UP_MAX, max(_CATCH_UP_MIN, per_second / 500))
        self.catch_up = catch_up
        self._next: float | None = None  # when the next slot opens (monotonic)

    def wait(self, now: float) -> float:
        """Seconds until the next slot opens (0: open now)."""
        return 0.0 if self._next is None else max(0.0, self._next - now)

    def take(self, now: float, most: int) -> int:
        """Take the slots open at ``now``, at most ``most``: how many commands go now."""
        if most <= 0 or (self._next is not None and now < self._next):
            return 0
        if not self.gap:
            return most
        start = now if self._next is None else max(self._next, now - self.catch_up)
        count = min(most, int((now - start) / self.gap) + 1)
        self._next = start + count * self.gap
        return count


class WriteThrough:
    """The ledger's changes written to the bucket in the order they were made, without
    waiting for each: up to ``window`` writes are in flight, the oldest waited for when the
    window is full; ``flush`` waits for all. A write the server refused, or left unanswered
    ``timeout`` s, raises (in the next ``put`` or ``flush``), and the controller stops.

    A controller killed with writes in flight loses at most the last ``window`` changes,
    each of which a restart re-derives: a reply is read again from the replies stream, an
    unrecorded send goes again with the same command id (run once all the same).
    """

    def __init__(self, js: Any, *, window: int = 256, timeout: float = 5.0) -> None:
        self.js = js
        self.window = window
        self.timeout = timeout
        self._flight: deque[asyncio.Future[Any]] = deque()

    async def put(self, subject: str, data: bytes) -> None:
        self._flight.append(await self.js.publish_async(subject, data))
        while self._flight and (len(self._flight) > self.window or self._flight[0].done()):
            await self._settle(self._flight.popleft())

    async def flush(self) -> None:
        while self._flight:
            await self._settle(self._flight.popleft())

    async def _settle(self, written: asyncio.Future[Any]) -> None:
        try:
            await asyncio.wait_for(written, self.timeout)
        except TimeoutError:
            raise MeshForgeError(
                f"a write to the jobs bucket went unanswered for {self.timeout:g}s"
            ) from None


class JobController:
    """Drives one job to its end: ``run()`` returns ``completed``, ``aborted`` or ``canceled``."""

    def __init__(
        self,
        conn: Connection,
        store: JobStore,
        job: str,
        *,
        client: ControlClient | None = None,
        poll: float = 0.5,
        metrics: Metrics | None = None,
        lease_ttl: float = 5.0,
    ) -> None:
        self.conn = conn
        self.store = store
        self.job = job
        self.client = client or ControlClient(conn, source=f"job:{job}")
        self.poll = poll
        self.metrics = metrics
        self.lease_ttl = lease_ttl
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._lease = 0
        self._lease_at = 0.0
        self.sent = 0  # commands this controller published (re-sends included)
        self.ledger = Ledger([], {})
        self._ids: dict[str, tuple[str, int]] = {}
        self._replies: asyncio.Queue[Reply] = asyncio.Queue()
        self._writes = WriteThrough(store.js)  # where the store reads, its writes go
        self._pacer = Pacer(None)
        self._cancel_check = 0.0  # when to look for a cancel next (monotonic)
        self._deadline: datetime | None = None
        self._expired = False  # the deadline's verdicts are given
        self._stopped: str | None = None  # "canceled" or "aborted": nothing more is sent

    @property
    def records(self) -> dict[str, NodeJob]:
        """Every target's record as this controller holds it."""
        return self.ledger.records

    async def run(self) -> str:
        """Send, follow and record until every node is done; the job's final status."""
        spec = await self.store.spec(self.job)
        await self._take_lease()
        try:
            return await self._drive(spec)
        finally:
            with contextlib.suppress(Exception):
                await self.store.drop_lease(self.job, self._lease)

    async def _take_lease(self) -> None:
        """Wait for the job's lease: a controller that died leaves it to expire."""
        waited = False
        while (lease := await self.store.take_lease(self.job, self.owner, self.lease_ttl)) is None:
            if not waited:
                log.info("job %s: another controller holds it; waiting for its lease", self.job)
                waited = True
            await asyncio.sleep(min(1.0, self.lease_ttl / 4))  # the lease's own expiry paces this
        self._lease = lease
        self._lease_at = time.monotonic()

    async def _drive(self, spec: JobSpec) -> str:
        # The one read of the bucket: from here on the ledger is the state, written through.
        self.ledger = Ledger(spec.targets, await self.store.nodes(self.job))
        self._pacer = Pacer(spec.rate)
        self._deadline = _ts(spec.deadline) if spec.deadline else None
        for site, node in spec.targets:
            for attempt in range(1, spec.retries + 2):
                self._ids[attempt_id(spec.job, site, node, attempt)] = (f"{site}.{node}", attempt)
        status = await self.store.status(self.job)
        if status["status"] in ("aborted", "canceled"):
            await self._stop(status["status"])
        else:  # the retries a controller that died owed
            for record in self.ledger.in_state("FAILED", "TIMED_OUT"):
                await self._retry(spec, record)
        sub = await self._follow(spec)
        log.info("job %s: %d node(s), driving", self.job, len(self.records))
        try:
            while True:
                await self._renew()
                await self._step(spec)
                self._export()
                if self.ledger.finished:
                    final = self._stopped or "completed"
                    await self._writes.flush()  # every node's state stored before the job's
                    await self.store.set_status(self.job, final, self._reason())
                    log.info("job %s %s: %s", self.job, final, summarize(self.records))
                    return final
                await self._wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _renew(self) -> None:
        if time.monotonic() - self._lease_at >= self.lease_ttl / 3:
            self._lease = await self.store.renew_lease(
                self.job, self.owner, self.lease_ttl, self._lease
            )
            self._lease_at = time.monotonic()

    def _export(self) -> None:
        if self.metrics is None:
            return
        now = self.ledger.figures()
        for state, count in now["counts"].items():
            self.metrics.job_nodes.labels(job_name=self.job, state=state).set(count)
        self.metrics.job_failed_share.labels(job_name=self.job).set(now["failed_share"])
        self.metrics.job_oldest_in_progress.labels(job_name=self.job).set(
            now["oldest_in_progress_seconds"]
        )

    def _reason(self) -> str | None:
        return "canceled by an operator" if self._stopped == "canceled" else None

    async def _follow(self, spec: JobSpec) -> Any:
        start = _ts(spec.created_at) - _LOOKBACK
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start)

        async def on_reply(msg: Msg) -> None:
            headers = text_headers(msg.headers)
            cause = headers.get(H_CAUSATION)
            if cause is not None and cause not in self._ids:
                return
            try:
                reply = Reply.from_envelope(decode(msg.data, headers))
            except MalformedMessage:
                return
            if reply.command_id in self._ids:
                self._replies.put_nowait(reply)

        return await self.conn.js.subscribe(
            "control.reply.>",
            stream=STREAM_REPLIES,
            ordered_consumer=True,
            config=config,
            cb=on_reply,
        )

    async def _wait(self) -> None:
        timeout = self.poll
        if self._stopped is None and self.ledger.count("QUEUED"):
            timeout = min(timeout, self._pacer.wait(time.monotonic()))
        with contextlib.suppress(TimeoutError):
            reply = await asyncio.wait_for(self._replies.get(), timeout)
            self._replies.put_nowait(reply)

    async def _save(self, record: NodeJob) -> None:
        self.ledger.put(record)
        await self._writes.put(self.store.node_subject(self.job, record), record.encode())

    def _past_deadline(self, now: datetime | None = None) -> bool:
        return self._deadline is not None and self._deadline <= (now or datetime.now(UTC))

    async def _step(self, spec: JobSpec) -> None:
        while not self._replies.empty():
            await self._apply(spec, self._replies.get_nowait())
        await self._check_cancel()
        now = datetime.now(UTC)
        past_deadline = self._past_deadline(now)
        if past_deadline and not self._expired:
            await self._expire()
        if spec.timeout is not None and not past_deadline:
            for record in self.ledger.overdue(now, spec.timeout):
                timed_out = record.to("TIMED_OUT", error=f"no reply within {spec.timeout:g}s")
                await self._save(timed_out)
                await self._retry(spec, timed_out)
        await self._check_abort(spec)
        if not past_deadline:
            await self._send_due(spec)

    async def _apply(self, spec: JobSpec, reply: Reply) -> None:
        key, attempt = self._ids[reply.command_id]
        record = self.records.get(key)
        if (
            record is None
            or attempt < record.attempt
            or (record.by_reply and attempt == record.attempt)
        ):
            return  # an older attempt's late answer, or one already recorded
        state = _FROM_REPLY[reply.status]
        answered = record.to(
            state, attempt=attempt, command_id=reply.command_id, result=reply.result,
            error=reply.error, node_epoch=reply.node_epoch, by_reply=True,
        )  # fmt: skip
        await self._save(answered)
        await self._retry(spec, answered)

    async def _retry(self, spec: JobSpec, record: NodeJob) -> None:
        """Put a failed or timed-out node back in the queue while it has attempts left."""
        if record.state not in ("FAILED", "TIMED_OUT") or record.attempt > spec.retries:
            return
        if self._stopped is not None or self._past_deadline():
            return
        log.info(
            "job %s: %s %s at attempt %d, sending again",
            self.job, record.key, record.state, record.attempt,
        )  # fmt: skip
        await self._save(record.to("QUEUED", by_reply=False))

    async def _check_cancel(self) -> None:
        """Look for an operator's cancel, once a ``poll`` at most (a read of the bucket)."""
        if self._stopped is not None or time.monotonic() < self._cancel_check:
            return
        self._cancel_check = time.monotonic() + self.poll
        if await self.store.canceled(self.job):
            await self.store.set_status(self.job, "canceled", "canceled by an operator")
            await self._stop("canceled")

    async def _stop(self, why: str) -> None:
        """Send nothing more: the nodes not sent yet are ``CANCELED`` (one pass, once)."""
        self._stopped = why
        for record in self.ledger.in_state("QUEUED"):
            await self._save(record.to("CANCELED", error=f"job {why} before it was sent"))

    async def _expire(self) -> None:
        """The deadline passed: the nodes not sent and those unanswered are ``EXPIRED``."""
        self._expired = True
        for record in self.ledger.in_state("QUEUED", "IN_PROGRESS"):
            if record.state == "QUEUED":
                error = "the job's deadline passed before it was sent"
            else:
                # The letter carried a TTL up to the deadline: the server removed it unless
                # the node took it; a reply that still comes replaces this verdict.
                error = "no reply by the job's deadline"
            await self._save(record.to("EXPIRED", error=error))

    async def _check_abort(self, spec: JobSpec) -> None:
        if spec.abort_after is None or self._stopped is not None:
            return
        done, failed = self.ledger.done_and_failed()
        if done >= spec.min_done and failed * 100 >= spec.abort_after * done:
            reason = f"{failed} of {done} done failed (abort after {spec.abort_after:g}%)"
            log.warning("job %s aborted: %s", self.job, reason)
            await self.store.set_status(self.job, "aborted", reason)
            await self.store.cancel(self.job)  # commands sent but not started answer CANCELED
            await self._stop("aborted")

    async def _send_due(self, spec: JobSpec) -> None:
        if self._stopped is not None:
            return
        due = self._pacer.take(time.monotonic(), min(self.ledger.count("QUEUED"), _BATCH))
        batch = [record for _ in range(due) if (record := self.ledger.next_queued()) is not None]
        if batch:
            await self._renew()  # a long run of sends keeps the lease too
            await self._send(spec, batch)

    async def _send(self, spec: JobSpec, batch: list[NodeJob]) -> None:
        """Publish the batch's commands pipelined, then record each one stored as sent. One
        the server did not take in time goes back to the queue (sent again with the same
        id: stored once); one it refused fails the controller once the others are recorded."""
        ttl = self._ttl(spec)
        items = [
            self.client.command(
                record.site, record.node, spec.command, spec.payload,
                not_before=spec.not_before, deadline=spec.deadline, job=spec.job, ttl=ttl,
                command_id=attempt_id(spec.job, record.site, record.node, record.attempt + 1),
            )
            for record in batch
        ]  # fmt: skip
        outcomes = await self.client.send_many(items)
        sent_at = now_ts()
        refused: PublishError | None = None
        for record, item, outcome in zip(batch, items, outcomes, strict=True):
            if isinstance(outcome, PublishError):
                if outcome.retriable:
                    log.warning(
                        "job %s: %s not sent, sending again: %s", self.job, record.key, outcome
                    )
                    self.ledger.again(record)
                else:
                    refused = refused or outcome
                continue
            self.sent += 1
            crash_point("job_after_send")
            await self._save(
                record.to(
                    "IN_PROGRESS", attempt=record.attempt + 1, command_id=item.msg_id,
                    sent_at=sent_at, result=None, error=None, by_reply=False,
                )
            )  # fmt: skip
        if refused is not None:
            await self._writes.flush()
            raise refused

    @staticmethod
    def _ttl(spec: JobSpec) -> float | None:
        """How long the letter may wait: up to the deadline, or the attempt's timeout."""
        now = datetime.now(UTC)
        start = max(now, _ts(spec.not_before)) if spec.not_before else now
        limits = []
        if spec.deadline is not None:
            limits.append((_ts(spec.deadline) - now).total_seconds())
        if spec.timeout is not None:
            limits.append((start - now).total_seconds() + spec.timeout)
        return max(1.0, min(limits)) if limits else None


async def job_report(store: JobStore, job: str) -> dict[str, Any]:
    """A job's state as `ctl job status --json` prints it and the console shows it."""
    spec = await store.spec(job)
    records = await store.nodes(job)
    status = await store.status(job)
    if status["status"] == "running" and await store.canceled(job):
        status = {
            **status,
            "status": "canceling",
            "reason": "canceled; its controller finishes the cancel",
        }
    return {
        "job": job, "command": spec.command, "status": status["status"], "reason": status.get("reason"),
        "created_at": spec.created_at, "targets": len(spec.targets), **figures(records), "at": now_ts(),
        "nodes": [
            {"site": r.site, "node": r.node, "state": r.state, "attempt": r.attempt,
             "command_id": r.command_id, "node_epoch": r.node_epoch, "error": r.error,
             "updated_at": r.updated_at}
            for r in sorted(records.values(), key=lambda r: r.key)
        ],
    }  # fmt: skip
