"""Per-resource order across fetches, restarts and hand-overs: the hold.

A command is applied only when no earlier command of its resource (by stream sequence)
is still to be applied. ``Holds`` keeps, per resource, the stream sequences of its
commands that are outstanding: delivered here and neither applied nor dead-lettered yet
(in flight, or nak'ed and due again), and those a durable had unacknowledged when this
worker took it (``seed``: a previous owner's in-flight work, a command nak'ed before a
restart). A later command that finds an earlier one outstanding is held: nak'ed to come
back just after it is due. The commands stream is the record (a work queue keeps exactly
the commands not yet acknowledged), so the hold survives any crash; an entry that stays
away past its due time is checked against the stream and dropped once the message is
gone (another worker acknowledged it).

Held deliveries are not attempts: each is counted in the store (``meshforge_holds``)
before its nak goes out, and the engine's delivery limit applies to ``num_delivered``
less that count. With nothing outstanding elsewhere a command costs two dict operations.

Example (what ``Engine`` does with a group)::

    holds.arrive(works)
    run, held = holds.split(works)        # held: [(work, delay)]
    ...                                   # run commits; then for each work:
    holds.settle(slot, seq)               # applied or dead-lettered
    holds.away(slot, seq, delay)          # nak'ed: due again after delay
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from meshforge.errors import one_line
from meshforge.topology.scope import Scope
from meshforge.transport.headers import text_headers

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from meshforge.consume.decisions import Delivery
    from meshforge.envelope import Envelope
    from meshforge.store.base import Transaction
    from meshforge.topology.specs import ConsumerSpec

__all__ = ["HoldView", "Holds", "Slot", "list_holds", "release", "seed_from_stream", "stream_has"]

log = logging.getLogger("meshforge.engine")

Slot = tuple[Scope, str]  # a resource of one scope
Key = tuple[Scope, str]  # an idempotency key of one scope


class Held(Protocol):
    """What holding needs of a delivery on its way (the engine's ``Work``), so it need not import it."""

    @property
    def delivery(self) -> Delivery: ...
    @property
    def env(self) -> Envelope: ...
    @property
    def resource(self) -> str: ...
    @property
    def scope(self) -> Scope: ...


W = TypeVar("W", bound=Held)

# A held command comes back this long after the command it waits for is due.
_AFTER = 0.2
# A blocker whose due time is unknown (found unacknowledged at a take-over): held
# commands look again at least this often.
_UNKNOWN_POLL = 2.0
# A blocker in flight here (another group commits or publishes it, or a slow handler runs):
# held commands look again this often.
_HERE_POLL = 1.0
# How long past its due time a blocker may stay away before the stream is asked about it.
_GRACE = 1.0
# A blocker "in flight here" this long is asked about too (a consumer that stopped and
# nak'ed it without the engine: it may have gone to another worker since).
_STUCK = 60.0
# Behind a dead-lettered head kept by ``Agent.hold_after_dead_letter``: how often held
# commands come back, and how often the store is read again for a release.
STOPPED_POLL = 5.0

_UPSERT = """
INSERT INTO meshforge_holds (tenant, namespace, consumer, key, resource_id, seq, held, since, updated_at)
VALUES (?, ?, ?, ?, ?, ?, 1, ?, ?)
ON CONFLICT (tenant, namespace, consumer, key) DO UPDATE SET
    held = meshforge_holds.held + 1, seq = excluded.seq, updated_at = excluded.updated_at
"""
_STOP = """
INSERT INTO meshforge_holds (tenant, namespace, consumer, key, resource_id, seq, held, stopped, since, updated_at)
VALUES (?, ?, ?, ?, ?, ?, 0, 1, ?, ?)
ON CONFLICT (tenant, namespace, consumer, key) DO UPDATE SET stopped = 1, updated_at = excluded.updated_at
"""
_DELETE = (
    "DELETE FROM meshforge_holds WHERE tenant = ? AND namespace = ? AND consumer = ? AND key = ?"
)
_LOAD = "SELECT tenant, namespace, key, held, stopped, resource_id FROM meshforge_holds WHERE consumer = ?"
_COUNT = "SELECT held FROM meshforge_holds WHERE tenant = ? AND namespace = ? AND consumer = ? AND key = ?"


@dataclass(slots=True)
class _Entry:
    here: bool  # in flight in this worker now
    due: float  # monotonic time it is expected back (while away); arrived here (while here)
    since: float  # monotonic time it was first seen outstanding
    known: bool = True  # False: found at a take-over, its due time a guess
    checked: float = 0.0  # monotonic time the stream last said it is still there


class Holds:
    """The outstanding commands of one agent's resources, shared by the engines of a worker.

    ``present(seq)`` answers whether the commands stream still has that message (None:
    entries are only ever settled by this worker).
    """

    def __init__(
        self, consumer: str, *, present: Callable[[int], Awaitable[bool]] | None = None
    ) -> None:
        self.consumer = consumer
        self.present = present
        self._open: dict[Slot, dict[int, _Entry]] = {}
        self._held: dict[int, float] = {}  # seq held back -> since (monotonic)
        #: Held deliveries per key, as the store counts them.
        self.counts: dict[Key, int] = {}
        #: Resources stopped behind a dead-lettered head (its key), until it is re-driven
        #: and applied or an operator releases the resource.
        self.stopped: dict[Slot, str] = {}
        self.loaded_at = 0.0  # monotonic time of the last ``load``
        self._forget: set[Key] = set()  # keys whose rows the next transaction deletes

    # ------------------------------------------------------------------ the index

    def arrive(self, works: Iterable[Held]) -> None:
        """These deliveries are in flight here."""
        now = time.monotonic()
        for w in works:
            entries = self._open.setdefault((w.scope, w.resource), {})
            entry = entries.get(w.delivery.seq)
            if entry is None:
                entries[w.delivery.seq] = _Entry(True, now, now)
            else:
                entry.here, entry.due = True, now

    def seed(self, found: Iterable[tuple[Slot, int]], due_in: float) -> None:
        """Commands a durable had unacknowledged when this worker took it, expected back
        within ``due_in`` seconds."""
        now = time.monotonic()
        for slot, seq in found:
            self._open.setdefault(slot, {}).setdefault(
                seq, _Entry(False, now + due_in, now, known=False)
            )

    def quiet(self, works: Iterable[Held]) -> bool:
        """Nothing but these works is outstanding for their resources (the usual case)."""
        return not self.stopped and all(
            len(self._open.get((w.scope, w.resource), ())) <= 1 for w in works
        )

    def split(self, works: Sequence[W]) -> tuple[list[W], list[tuple[W, float]]]:
        """The works (in stream order) that may run now, and those held with their nak
        delays: a work is held when an earlier command of its resource is outstanding
        outside this group, or an earlier one of this group is held."""
        run: list[W] = []
        held: list[tuple[W, float]] = []
        now = time.monotonic()
        group = {w.delivery.seq for w in works}
        waits: dict[Slot, float] = {}
        for w in works:
            slot = (w.scope, w.resource)
            delay = waits.get(slot)
            if delay is None:
                delay = self._wait(w, group, now)
            if delay is None:
                run.append(w)
                continue
            waits[slot] = delay
            held.append((w, delay))
            self._held.setdefault(w.delivery.seq, now)
        return run, held

    def _wait(self, w: Held, group: set[int], now: float) -> float | None:
        """The nak delay for a work that must wait, else None."""
        slot, seq = (w.scope, w.resource), w.delivery.seq
        head = self.stopped.get(slot)
        wait: float | None = None if head is None or head == w.env.key else STOPPED_POLL
        for s, e in self._open.get(slot, {}).items():
            if s >= seq or s in group:
                continue
            if e.here:
                due = _HERE_POLL
            else:
                due = max(e.due - now, 0.0) + _AFTER
                if not e.known:
                    due = min(due, _UNKNOWN_POLL)
            wait = due if wait is None else max(wait, due)
        return wait

    def settle(self, slot: Slot, seq: int) -> None:
        """Applied, or dead-lettered: no longer holds anything back."""
        self._held.pop(seq, None)
        entries = self._open.get(slot)
        if entries is not None:
            entries.pop(seq, None)
            if not entries:
                del self._open[slot]

    def finish(self, work: Held) -> None:
        """Applied or dead-lettered: it holds nothing back, and its count row goes."""
        self.settle((work.scope, work.resource), work.delivery.seq)
        self.forget(work.scope, work.env.key)

    def away(self, slot: Slot, seq: int, delay: float) -> None:
        """Nak'ed: due again after ``delay`` seconds."""
        entry = self._open.get(slot, {}).get(seq)
        if entry is not None:
            entry.here, entry.known = False, True
            entry.due = time.monotonic() + delay

    async def recheck(self, works: Iterable[Held]) -> None:
        """Ask the stream about blockers of these works that stayed away past their due
        time; drop the ones it no longer has (acknowledged by another worker)."""
        if self.present is None:
            return
        now = time.monotonic()
        for slot in {(w.scope, w.resource) for w in works}:
            for seq, e in list(self._open.get(slot, {}).items()):
                late = now > e.due + (_STUCK if e.here else _GRACE)
                if not late or now - e.checked < _GRACE:
                    continue
                if await self.present(seq):
                    e.checked = time.monotonic()
                else:
                    self.settle(slot, seq)

    # ------------------------------------------------------------------ metrics

    def held_now(self) -> tuple[int, float]:
        """Commands held back now, and the age in seconds of the oldest hold."""
        if not self._held:
            return 0, 0.0
        return len(self._held), time.monotonic() - min(self._held.values())

    # ------------------------------------------------------------------ held deliveries

    def attempts(self, scope: Scope, key: str, num_delivered: int) -> int:
        """Deliveries of a command that were attempts (not held)."""
        if not self.counts:
            return num_delivered
        return max(num_delivered - self.counts.get((scope, key), 0), 1)

    def count(self, tx: Transaction, held: Sequence[Held]) -> None:
        """Count one held delivery for each (in the store first, then here)."""
        self._write(tx, _UPSERT, held)
        for w in held:
            key = (w.scope, w.env.key)
            self.counts[key] = self.counts.get(key, 0) + 1
            self._forget.discard(key)

    def forget(self, scope: Scope, key: str) -> None:
        """The command was applied or dead-lettered: its row goes with the next transaction."""
        if self.counts.pop((scope, key), None) is not None:
            self._forget.add((scope, key))

    def applied(self, slot: Slot, key: str) -> None:
        """A command was applied: if it was its resource's dead-lettered head (re-driven),
        the resource goes on."""
        if self.stopped.get(slot) == key:
            del self.stopped[slot]
            self._forget.add((slot[0], key))

    def stop(self, tx: Transaction, heads: Sequence[Held]) -> None:
        """Keep these dead-lettered commands' resources held (in the store first)."""
        self._write(tx, _STOP, heads)
        for w in heads:
            self.stopped[(w.scope, w.resource)] = w.env.key

    def _write(self, tx: Transaction, sql: str, works: Sequence[Held]) -> None:
        now = time.time()
        for w in works:
            tx.execute(sql, (
                w.scope.tenant, w.scope.namespace, self.consumer, w.env.key, w.resource,
                w.delivery.seq, now, now,
            ))  # fmt: skip

    def clear_forgotten(self, tx: Transaction) -> None:
        """Delete the count rows of commands applied or dead-lettered since the last call."""
        while self._forget:
            scope, key = self._forget.pop()
            tx.execute(_DELETE, (scope.tenant, scope.namespace, self.consumer, key))

    def load(self, tx: Transaction, keys: Sequence[Key] = ()) -> None:
        """Read what the store holds for this consumer: every count and stopped resource
        (at start, after a take-over, while a resource is stopped), or only the counts of
        ``keys`` (commands near their limit, which another worker may have held)."""
        if keys:
            for scope, key in keys:
                found = tx.execute(_COUNT, (scope.tenant, scope.namespace, self.consumer, key))
                if found and found[0][0]:
                    self.counts[(scope, key)] = int(found[0][0])
            return
        rows: list[tuple[Any, ...]] = tx.execute(_LOAD, (self.consumer,))
        stopped: dict[Slot, str] = {}
        for tenant, namespace, key, held, stop, resource in rows:
            scope = Scope(tenant, namespace)
            if held:
                self.counts[(scope, key)] = int(held)
            if stop:
                stopped[(scope, resource)] = key
        self.stopped = stopped
        self.loaded_at = time.monotonic()

    def stale(self) -> bool:
        """Whether a stopped resource may have been released since the last ``load``."""
        return bool(self.stopped) and time.monotonic() - self.loaded_at > STOPPED_POLL


async def stream_has(js: JetStreamContext, stream: str, seq: int) -> bool:
    """Whether ``stream`` still holds message ``seq`` (a work queue drops what was acked)."""
    from nats.js.errors import NotFoundError

    try:
        await js.get_msg(stream, seq=seq)
    except NotFoundError:
        return False
    return True


async def seed_from_stream(
    holds: Holds,
    js: JetStreamContext,
    spec: ConsumerSpec,
    slot_of: Callable[[str, bytes, dict[str, str]], Slot | None],
) -> int | None:
    """Enter into ``holds`` what the durable has delivered and not had acknowledged (read
    from the stream between its ack floor and its last delivery), before this worker
    pulls from it. Returns how many; None when the stream cannot be read by sequence (a
    role without it: then only what this worker is delivered itself keeps the order)."""
    from nats.js.errors import NotFoundError

    found: list[tuple[Slot, int]] = []
    try:
        info = await js.consumer_info(spec.stream, spec.durable)
        if not info.num_ack_pending:
            return 0
        last = info.delivered.stream_seq or 0
        cfg = info.config
        due_in = max([*(cfg.backoff or []), cfg.ack_wait or spec.effective_ack_wait])
        seq = (info.ack_floor.stream_seq or 0) + 1
        while seq <= last:
            try:
                msg = await js.get_msg(spec.stream, seq=seq, subject=spec.filter_subject, next=True)
            except NotFoundError:
                break
            if msg.seq is None or msg.seq > last:
                break
            # get_msg gives non-ASCII values as email Header objects
            slot = slot_of(msg.subject or "", msg.data or b"", text_headers(msg.headers))
            if slot is not None:
                found.append((slot, msg.seq))
            seq = msg.seq + 1
    except Exception as exc:  # e.g. a role without STREAM.MSG.GET: order holds within this worker
        log.warning("%s: cannot read its unacknowledged commands (%s); later commands of"
                    " their resources are not held for them", spec.durable, one_line(exc))  # fmt: skip
        return None
    holds.seed(found, due_in)
    return len(found)


# ---------------------------------------------------------------------- for operators


@dataclass(frozen=True, slots=True)
class HoldView:
    """One held resource as the store has it (``meshforge holds ls``)."""

    consumer: str
    scope: Scope
    resource: str
    held: int  # commands counted as held back now
    deliveries: int  # their held deliveries so far
    since: float  # epoch seconds of the oldest
    stopped_by: str | None  # the key of a dead-lettered head it stays held behind


def list_holds(tx: Transaction, consumer: str | None = None) -> list[HoldView]:
    """Held resources, oldest first."""
    where, params = ("WHERE consumer = ?", (consumer,)) if consumer else ("", ())
    rows = tx.execute(
        "SELECT consumer, tenant, namespace, resource_id, key, held, stopped, since"
        f" FROM meshforge_holds {where} ORDER BY since",
        params,
    )
    views: dict[tuple[str, Scope, str], list[tuple[Any, ...]]] = {}
    for row in rows:
        views.setdefault((row[0], Scope(row[1], row[2]), row[3]), []).append(row)
    out = []
    for (name, scope, resource), group in views.items():
        stopped = next((r[4] for r in group if r[6]), None)
        counted = [r for r in group if r[5]]
        out.append(HoldView(name, scope, resource, len(counted), sum(int(r[5]) for r in counted),
                            float(min(r[7] for r in group)), stopped))  # fmt: skip
    return sorted(out, key=lambda v: v.since)


def release(tx: Transaction, consumer: str, scope: Scope, resource: str) -> int:
    """Let a resource stopped behind a dead-lettered head go on; returns the rows released.
    Its workers see it within ``STOPPED_POLL`` seconds."""
    return len(tx.execute(
        "DELETE FROM meshforge_holds WHERE consumer = ? AND tenant = ? AND namespace = ?"
        " AND resource_id = ? AND stopped = 1 RETURNING key",
        (consumer, scope.tenant, scope.namespace, resource),
    ))  # fmt: skip
