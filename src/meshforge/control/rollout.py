"""The job controller: sends a job's command to its nodes at the job's rate and follows
their replies, with every step written to the jobs bucket first or re-derivable after.

One controller drives a job at a time (a lease in the bucket, renewed as it goes; a
second one waits for it). A controller killed at any point and started again (once its
lease has expired, within seconds) reads the bucket, reads the replies
since the job was created (so an answer that came while it was down is not missed) and
goes on; a command it sent but did not record is sent again with the same id, which the
server's duplicate window (or, later, the node's reply log) keeps from running twice.

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
from collections import Counter
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
from meshforge.errors import MalformedMessage
from meshforge.ops.faults import crash_point
from meshforge.ops.observability import Metrics
from meshforge.topology.subjects import STREAM_REPLIES
from meshforge.transport.connection import Connection
from meshforge.transport.headers import text_headers

__all__ = ["JobController", "figures", "summarize"]

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


def _ts(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def summarize(records: dict[str, NodeJob]) -> dict[str, int]:
    """How many nodes are in each state (every state named, zeros included)."""
    counts = Counter(r.state for r in records.values())
    return {state: counts.get(state, 0) for state in NODE_STATES}


def figures(records: dict[str, NodeJob], now: datetime | None = None) -> dict[str, Any]:
    """Counts by state, the failed share of the nodes done (canceled ones aside) and the
    oldest command in progress (when it was sent, and its age in seconds)."""
    counts = summarize(records)
    done = sum(n for s, n in counts.items() if s in TERMINAL and s != "CANCELED")
    failed = sum(counts[s] for s in FAILED_STATES)
    sent = [r.sent_at for r in records.values() if r.state == "IN_PROGRESS" and r.sent_at]
    oldest = min(sent) if sent else None
    age = ((now or datetime.now(UTC)) - _ts(oldest)).total_seconds() if oldest else 0.0
    return {
        "counts": counts,
        "failed_share": round(failed / done, 4) if done else 0.0,
        "oldest_in_progress": oldest,
        "oldest_in_progress_seconds": round(max(age, 0.0), 3),
    }


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
        self.records: dict[str, NodeJob] = {}
        self._ids: dict[str, tuple[str, int]] = {}
        self._replies: asyncio.Queue[Reply] = asyncio.Queue()
        self._next_send = 0.0
        self._stopped: str | None = None  # "canceled" or "aborted": nothing more is sent

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
        self.records = await self.store.nodes(self.job)
        for site, node in spec.targets:
            for attempt in range(1, spec.retries + 2):
                self._ids[attempt_id(spec.job, site, node, attempt)] = (f"{site}.{node}", attempt)
        status = await self.store.status(self.job)
        if status["status"] in ("aborted", "canceled"):
            self._stopped = status["status"]
        sub = await self._follow(spec)
        log.info("job %s: %d node(s), driving", self.job, len(self.records))
        try:
            while True:
                await self._renew()
                await self._step(spec)
                self._export()
                if all(r.terminal for r in self.records.values()):
                    final = self._stopped or "completed"
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
        now = figures(self.records)
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
        if self._sendable():
            timeout = max(0.0, min(timeout, self._next_send - time.monotonic()))
        with contextlib.suppress(TimeoutError):
            reply = await asyncio.wait_for(self._replies.get(), timeout)
            self._replies.put_nowait(reply)

    def _sendable(self) -> bool:
        return self._stopped is None and any(r.state == "QUEUED" for r in self.records.values())

    async def _save(self, record: NodeJob) -> None:
        self.records[record.key] = record
        await self.store.put_node(self.job, record)

    async def _step(self, spec: JobSpec) -> None:
        while not self._replies.empty():
            await self._apply(self._replies.get_nowait())
        if self._stopped is None and await self.store.canceled(self.job):
            self._stopped = "canceled"
            await self.store.set_status(self.job, "canceled", "canceled by an operator")
        now = datetime.now(UTC)
        past_deadline = spec.deadline is not None and _ts(spec.deadline) <= now
        for record in list(self.records.values()):
            await self._judge(spec, record, now, past_deadline)
        await self._check_abort(spec)
        await self._send_due(spec, past_deadline)

    async def _apply(self, reply: Reply) -> None:
        key, attempt = self._ids[reply.command_id]
        record = self.records.get(key)
        if (
            record is None
            or attempt < record.attempt
            or (record.by_reply and attempt == record.attempt)
        ):
            return  # an older attempt's late answer, or one already recorded
        state = _FROM_REPLY[reply.status]
        await self._save(
            record.to(
                state, attempt=attempt, command_id=reply.command_id, result=reply.result,
                error=reply.error, node_epoch=reply.node_epoch, by_reply=True,
            )
        )  # fmt: skip

    async def _judge(
        self, spec: JobSpec, record: NodeJob, now: datetime, past_deadline: bool
    ) -> None:
        """The controller's own verdicts: canceled, expired, timed out, retried."""
        if record.state == "QUEUED":
            if self._stopped is not None:
                await self._save(
                    record.to("CANCELED", error=f"job {self._stopped} before it was sent")
                )
            elif past_deadline:
                await self._save(
                    record.to("EXPIRED", error="the job's deadline passed before it was sent")
                )
            return
        if record.state == "IN_PROGRESS" and record.sent_at is not None:
            if past_deadline:
                # The letter carried a TTL up to the deadline: the server removed it unless the
                # node took it; a reply that still comes replaces this verdict.
                await self._save(record.to("EXPIRED", error="no reply by the job's deadline"))
                return
            if spec.timeout is None or (now - _ts(record.sent_at)).total_seconds() <= spec.timeout:
                return
            record = record.to("TIMED_OUT", error=f"no reply within {spec.timeout:g}s")
            await self._save(record)  # and retried below, in this same pass, if it may be
        retry = record.state in ("FAILED", "TIMED_OUT") and record.attempt <= spec.retries
        if retry and self._stopped is None and not past_deadline:
            log.info(
                "job %s: %s %s at attempt %d, sending again",
                self.job,
                record.key,
                record.state,
                record.attempt,
            )
            await self._save(record.to("QUEUED", by_reply=False))

    async def _check_abort(self, spec: JobSpec) -> None:
        if spec.abort_after is None or self._stopped is not None:
            return
        done = [r for r in self.records.values() if r.terminal and r.state != "CANCELED"]
        failed = sum(r.state in FAILED_STATES for r in done)
        if len(done) >= spec.min_done and failed * 100 >= spec.abort_after * len(done):
            reason = f"{failed} of {len(done)} done failed (abort after {spec.abort_after:g}%)"
            log.warning("job %s aborted: %s", self.job, reason)
            self._stopped = "aborted"
            await self.store.set_status(self.job, "aborted", reason)
            await self.store.cancel(self.job)  # commands sent but not started answer CANCELED
            for record in list(self.records.values()):
                if record.state == "QUEUED":
                    await self._save(record.to("CANCELED", error="job aborted before it was sent"))

    async def _send_due(self, spec: JobSpec, past_deadline: bool) -> None:
        if past_deadline:
            return
        gap = 60.0 / spec.rate if spec.rate else 0.0
        for site, node in spec.targets:
            record = self.records[f"{site}.{node}"]
            if self._stopped is not None or record.state != "QUEUED":
                continue
            if time.monotonic() < self._next_send:
                return
            await self._renew()  # a long burst of sends keeps the lease too
            await self._send(spec, record)
            self._next_send = time.monotonic() + gap

    async def _send(self, spec: JobSpec, record: NodeJob) -> None:
        attempt = record.attempt + 1
        command_id = attempt_id(spec.job, record.site, record.node, attempt)
        await self.client.send(
            record.site, record.node, spec.command, spec.payload,
            not_before=spec.not_before, deadline=spec.deadline, command_id=command_id,
            job=spec.job, ttl=self._ttl(spec),
        )  # fmt: skip
        self.sent += 1
        crash_point("job_after_send")
        await self._save(
            record.to(
                "IN_PROGRESS", attempt=attempt, command_id=command_id, sent_at=now_ts(),
                result=None, error=None, by_reply=False,
            )
        )  # fmt: skip

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
