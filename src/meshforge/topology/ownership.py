"""Partition ownership in one place: leases, take-over, pin checks, take-back, fencing.

A worker owns some of an agent's partition durables (``meshforge.topology.partitions``):
``Ownership`` keeps its leases in the ownership bucket (``Leases``) and, for each slot it
owns, a ``Tenure``: what the slot's consumer and its pull loop ask, and all they ask.

- ``claim()``, before the first pull: unpin the durable's priority group, so the server
  refuses every pull of the previous owner from then on (status 423), then ``settle``
  what the previous owner left unacknowledged. A worker that reads the commands stream
  by sequence enters it into its holds (``read_held``): later commands of those
  resources wait for it, whenever and in whatever order it comes back, so the new owner
  pulls at once. A worker that cannot read it (bound to a tenant, or its role lacks
  ``STREAM.MSG.GET``) and takes a slot that was not handed back waits for the longest
  redelivery delay instead and takes what comes back first back as one batch in stream
  order (``take_back``): the best it can do without the record.
- ``unpinned_idle()``, on an empty pull while the server has not pinned us: is another
  client pinned (a worker that stalled right after claiming pulls without a pin and can
  be pinned after our unpin)? Then take the slot over again, as at the claim.
- ``refused()``, on a 423: another client was given the durable. Fence the consumer
  (stop fetching, extend nothing, nak nothing: what it holds comes due for the new
  owner) and give the lease up. A failed lease renewal fences the same way.

Example (what the worker does; ``start_consumer`` claims, then runs a consumer given
``owner=tenure``)::

    ownership = Ownership(js, kv, partition_consumers("order", settings), run=start_consumer,
                          stop=stop_consumer, period=lease / 3, read_held=seed_holds)
    await ownership.run(first_round)      # rounds until cancelled
    await ownership.close()               # hand everything back
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from meshforge.errors import MissingTopology, TopologyError, one_line
from meshforge.topology.partitions import Leases, pinned_client, unpin

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

    from meshforge.topology.specs import ConsumerSpec

__all__ = ["Ownership", "Tenure"]

log = logging.getLogger("meshforge.partitions")

#: What the previous owner of a durable left unacknowledged, entered into this worker's
#: holds: how many (None: this worker cannot read the commands stream by sequence).
ReadHeld = Callable[["ConsumerSpec"], Awaitable["int | None"]]


class Tenure:
    """This worker's ownership of one slot, for as long as one consumer runs it.

    A tenure without an ``Ownership`` (``Tenure(spec)``: a consumer on a partition durable
    outside a worker) claims nothing and checks no pin; a 423 still fences its consumer.
    """

    def __init__(
        self,
        spec: ConsumerSpec,
        ownership: Ownership | None = None,
        *,
        slot: str = "",
        clean: bool = True,
    ) -> None:
        self.spec = spec
        self.slot = slot
        #: The slot's last owner handed it back (nothing of it can still be on its way back).
        self.clean = clean
        #: The priority group the pulls name (the server's fence), None without one.
        self.group: str | None = spec.priority_group or None
        #: Another client owns the durable now (refused, or our lease was lost).
        self.fenced = False
        self._ownership = ownership
        self._fence: Callable[[], None] | None = None
        self._due_back = 0

    def attach(self, fence: Callable[[], None]) -> None:
        """What fences the consumer (stop fetching, leave what it holds to come due)."""
        self._fence = fence
        if self.fenced:
            fence()

    def fence(self) -> None:
        """Someone else owns the slot now: the consumer stops at once (once)."""
        if self.fenced:
            return
        self.fenced = True
        if self._fence is not None:
            self._fence()

    async def claim(self) -> None:
        """Before the first pull: fence the previous owner off, then settle what it left."""
        if self._ownership is None:
            return
        await self._ownership.unpin(self.spec)
        await self._settle(self.clean)

    async def _settle(self, clean: bool) -> None:
        """What the previous owner left unacknowledged: into the holds, or (a worker that
        cannot read it, on a slot not handed back) waited for and taken back first."""
        assert self._ownership is not None
        found = await self._ownership.read_held(self.spec)
        if found:
            log.info("%s: %d unacknowledged by the previous owner; later commands of their"
                     " resources wait for them", self.spec.durable, found)  # fmt: skip
        if found is None and not clean:
            self._due_back += await self._ownership.await_redeliveries(self.spec)

    def take_back(self) -> int:
        """How many redeliveries the next pulls take back, as one batch in stream order,
        before anything else (0: none). Each count is given out once."""
        due, self._due_back = self._due_back, 0
        return due

    async def unpinned_idle(self, pinned: Callable[[], bool]) -> None:
        """An idle pull, and the server has not pinned us: if another client is pinned,
        take the slot over again (unpin, then settle what that client holds)."""
        if self._ownership is None or self.fenced:
            return
        try:
            pin = await pinned_client(
                self._ownership.js, self.spec.stream, self.spec.durable, self.spec.priority_group
            )
        except Exception as exc:  # the server may be away: the next idle pull asks again
            log.debug("%s: pin state unavailable: %s", self.spec.durable, one_line(exc))
            return
        if pin is None or pinned() or self.fenced:
            return
        log.warning(
            "%s: another client is pinned while this worker owns it; unpinning it",
            self.spec.durable,
        )
        await self._ownership.unpin(self.spec)
        await self._settle(clean=False)

    async def refused(self) -> None:
        """The server refused our pin (423): another client was given the durable."""
        self.fence()
        if self._ownership is not None:
            self._ownership.lose(self)


class Ownership:
    """One worker's share of one agent's partition durables (``specs``: slot -> spec, the
    unpartitioned durable as the spare slot ``u``).

    ``run(tenure)`` must start consuming ``tenure.spec`` at once: ``await tenure.claim()``,
    then run a consumer given ``owner=tenure``; ``stop(slot)``
    stops that consumer, finishing and acknowledging its in-flight work. ``read_held``
    enters what a durable has unacknowledged into the worker's holds (see the module
    docstring); ``last_error`` is the connection's last error, to tell a denied unpin from
    a server that does not answer.
    """

    def __init__(
        self,
        js: JetStreamContext,
        kv: KeyValue,
        specs: Mapping[str, ConsumerSpec],
        *,
        run: Callable[[Tenure], None],
        stop: Callable[[str], Awaitable[None]],
        period: float,
        read_held: ReadHeld,
        last_error: Callable[[], str | None] = lambda: None,
        spare: Sequence[str] = ("u",),
        worker: str | None = None,
    ) -> None:
        self.js = js
        self.specs = dict(specs)
        self.read_held = read_held
        self._run = run
        self._last_error = last_error
        self.tenures: dict[str, Tenure] = {}
        # Every durable of the group shares the unpartitioned one's stem.
        group = (
            self.specs["u"].durable.removesuffix("_unpartitioned")
            if "u" in self.specs
            else next(iter(self.specs))
        )
        self.leases = Leases(
            js, kv, group, list(self.specs), spare=[s for s in spare if s in self.specs], start=self.take,
            stop=stop, period=period, worker=worker, fence=self._lost,
        )  # fmt: skip

    def owns(self, slot: str) -> bool:
        """Whether this worker holds the lease of ``slot`` now."""
        return slot in self.leases.owned

    async def run(self, first_round: asyncio.Event | None = None) -> None:
        """Lease rounds until cancelled (``Leases.run``)."""
        await self.leases.run(first_round)

    async def close(self) -> None:
        """Hand every slot back (in-flight work finishes first)."""
        await self.leases.close()

    def take(self, slot: str, clean: bool) -> Tenure:
        """Start consuming ``slot`` (the leases call this for each slot they claim; ``clean``
        False: its last owner did not hand it back)."""
        tenure = self.tenures[slot] = Tenure(self.specs[slot], self, slot=slot, clean=clean)
        self._run(tenure)
        return tenure

    def _lost(self, slot: str) -> None:
        """Our lease of ``slot`` is gone (a renewal failed): its consumer stops at once."""
        tenure = self.tenures.get(slot)
        if tenure is not None:
            tenure.fence()

    def lose(self, tenure: Tenure) -> None:
        """The server fenced ``tenure`` off: stop the slot and renew it no more (unless the
        slot was started again meanwhile: a tenure of its past says nothing)."""
        if self.tenures.get(tenure.slot) is tenure:
            self.leases.lose(tenure.slot)

    async def unpin(self, spec: ConsumerSpec) -> None:
        """Revoke the durable's pin, trying again while the server does not answer; a
        missing group or a denied request is final."""
        delay = 0.1
        while True:
            try:
                await unpin(self.js, spec.stream, spec.durable, spec.priority_group)
                return
            except MissingTopology:
                raise
            except Exception as exc:  # no answer: the server is away or busy; a denial is final
                denied = self._last_error() or ""
                if "permissions violation" in denied.lower():
                    raise TopologyError(f"cannot unpin {spec.durable}: {denied}") from None
                log.warning(
                    "%s: unpin failed (%s); trying again before pulling",
                    spec.durable,
                    one_line(exc),
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

    async def await_redeliveries(self, spec: ConsumerSpec) -> int:
        """Let what the durable's previous owner holds come due (the longest redelivery
        delay) before this worker pulls. Returns how many there were: nothing more can be
        delivered to that owner after the unpin, so the server counts them all."""
        info = await self.js.consumer_info(spec.stream, spec.durable)
        if not info.num_ack_pending:
            return 0
        cfg = info.config
        wait = max([*(cfg.backoff or []), cfg.ack_wait or spec.effective_ack_wait])
        log.info("%s: %d unacknowledged; starting in %gs when they are due again",
                 spec.durable, info.num_ack_pending, wait)  # fmt: skip
        await asyncio.sleep(wait)
        return int(info.num_ack_pending)
