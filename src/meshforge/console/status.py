"""What the overview and nodes pages show, read from the server with the runtime's own code.

The console keeps a short history of every consumer's acknowledged count, sampled on
each overview refresh, so a throughput sparkline needs no metrics backend.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from meshforge.control.fleet import NodeRow, survey
from meshforge.deadletters.route import H_DLQ_REASON
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_FAILED, matches
from meshforge.transport.connection import Connection
from meshforge.transport.headers import text_headers
from meshforge.transport.listing import last_message

__all__ = ["ConsumerRow", "Overview", "StatusReader", "StreamRow"]

# A sparkline keeps this many samples; the reason count reads at most this many letters.
HISTORY = 30
REASON_SCAN_LIMIT = 5_000
# A guard, never waited out when all is well: the read stops at the last letter it knows of.
_REASON_GUARD = 10.0


@dataclass(frozen=True, slots=True)
class StreamRow:
    name: str
    messages: int
    bytes: int
    consumers: int


@dataclass(frozen=True, slots=True)
class ConsumerRow:
    stream: str
    name: str
    filter: str
    pending: int
    ack_pending: int
    redelivered: int
    waiting: int  # pull requests waiting: workers polling it now
    rates: list[float]  # acknowledged per second between samples, oldest first

    @property
    def workers_alive(self) -> bool:
        return self.waiting > 0 or self.ack_pending > 0


@dataclass(slots=True)
class Overview:
    streams: list[StreamRow] = field(default_factory=list)
    consumers: list[ConsumerRow] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    reasons_capped: bool = False
    nodes_alive: int = 0
    nodes_known: int = 0
    mailboxes: int = 0


def scope_filter(tenant: str | None) -> str | None:
    """The subjects a console bound to ``tenant`` may see: that tenant's commands."""
    return f"cmd.{tenant}.>" if tenant else None


class StatusReader:
    """Reads streams, consumers, dead-letter reasons and nodes; ``tenant`` narrows all of it."""

    def __init__(self, conn: Connection, *, tenant: str | None = None) -> None:
        self.conn = conn
        self.tenant = tenant
        self._acked: dict[str, collections.deque[tuple[float, int]]] = {}

    @property
    def js(self) -> JetStreamContext:
        return self.conn.js

    def _visible(self, subject_filter: str) -> bool:
        scope = scope_filter(self.tenant)
        if scope is None:
            return True
        parts = subject_filter.split(".")
        return (
            len(parts) > 1
            and parts[0] == "cmd"
            and parts[1] == self.tenant
            and matches(scope, subject_filter)
        )

    async def overview(self) -> Overview:
        view = Overview()
        infos = await self.js.streams_info()
        for info in sorted(infos, key=lambda i: i.config.name or ""):
            name = info.config.name or ""
            if self.tenant is None:
                view.streams.append(
                    StreamRow(
                        name,
                        int(info.state.messages),
                        int(info.state.bytes),
                        int(info.state.consumer_count),
                    )
                )
        if any(i.config.name == STREAM_COMMANDS for i in infos):
            view.consumers = await self._consumers(STREAM_COMMANDS)
        view.reasons, view.reasons_capped = await self.reasons_last_hour()
        if self.tenant is None:
            fleet = await survey(self.js)
            view.nodes_known = fleet.announced
            view.nodes_alive = sum(1 for n in fleet.rows if n.alive)
            view.mailboxes = fleet.mailboxes.count
        return view

    async def _consumers(self, stream: str) -> list[ConsumerRow]:
        rows = []
        now = time.monotonic()
        for info in await self.js.consumers_info(stream):
            config = info.config
            subject = config.filter_subject or ",".join(config.filter_subjects or []) or ">"
            if not self._visible(subject):
                continue
            name = info.name
            acked = int(info.ack_floor.consumer_seq if info.ack_floor else 0)
            history = self._acked.setdefault(name, collections.deque(maxlen=HISTORY + 1))
            if not history or now - history[-1][0] >= 1.0:
                history.append((now, acked))
            rows.append(
                ConsumerRow(
                    stream,
                    name,
                    subject,
                    int(info.num_pending or 0),
                    int(info.num_ack_pending or 0),
                    int(info.num_redelivered or 0),
                    int(info.num_waiting or 0),
                    _rates(history),
                )
            )
        return rows

    async def reasons_last_hour(self) -> tuple[dict[str, int], bool]:
        """Dead letters stored in the last hour, per ``Dlq-Reason``; reads headers only, and
        at most ``REASON_SCAN_LIMIT`` of them (True when it stopped there)."""
        since = datetime.now(UTC) - timedelta(hours=1)
        subject = "failed." + (scope_filter(self.tenant) or ">")
        try:
            last = await last_message(self.js, STREAM_FAILED, subject)
        except nats.js.errors.NotFoundError:
            return {}, False
        if last is None or datetime.fromisoformat(last[1]) < since:
            return {}, False  # no letter in the last hour: nothing to read
        upto = last[0]
        try:
            sub = await self.js.subscribe(
                subject,
                stream=STREAM_FAILED,
                ordered_consumer=True,
                config=ConsumerConfig(
                    deliver_policy=DeliverPolicy.BY_START_TIME,
                    opt_start_time=since,
                    headers_only=True,
                ),
            )
        except nats.js.errors.NotFoundError:
            return {}, False
        counts: collections.Counter[str] = collections.Counter()
        try:
            for _ in range(REASON_SCAN_LIMIT):
                try:
                    msg = await sub.next_msg(timeout=_REASON_GUARD)
                except (TimeoutError, nats.errors.TimeoutError):
                    return dict(counts), False
                if not (msg.subject or "").startswith("failed.original."):
                    reason = text_headers(msg.headers).get(H_DLQ_REASON, "")
                    counts[reason or "unknown"] += 1
                meta = msg.metadata
                if meta.sequence.stream >= upto or meta.num_pending == 0:
                    return dict(counts), False
            return dict(counts), True
        finally:
            await sub.unsubscribe()

    async def nodes(self) -> list[NodeRow]:
        """Every node that ever announced itself, with epoch, last seen and mailbox depth:
        a few requests however many nodes there are (``meshforge.control.fleet``)."""
        if self.tenant is not None:
            return []  # nodes belong to sites, not tenants: a tenant's console has none
        return (await survey(self.js)).rows


def _rates(history: collections.deque[tuple[float, int]]) -> list[float]:
    points = list(history)
    return [max(0.0, (b[1] - a[1]) / max(b[0] - a[0], 1e-3)) for a, b in itertools.pairwise(points)]
