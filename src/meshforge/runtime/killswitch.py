"""The kill switch: an outage of our own pauses the work, it never dead-letters it.

A failure that is not about the message (the store unavailable, its disk full or
read-only, its connection lost; the NATS server away) opens the worker's switch. While it
is open the consumers fetch nothing more, what they hold is kept alive with
``in_progress`` (so its delivery count does not grow), and the engine tries its held
transaction again after growing delays (the probe) until the store answers; the first
success closes the switch and the work goes on by itself. ``/readyz`` answers 503 while it
is open. The log has one ERROR line when it opens, one when it closes, and a reminder at
most once a minute in between; ``meshforge_kill_switch_open{cause}`` is 1 meanwhile.

A failure that only one message causes (data the store can never hold, found by the
engine's bisection) is still that message's: only the store's ``unavailable`` errors are
outages (``is_outage``).

Example::

    switch = KillSwitch(metrics)
    try:
        plan = run_transaction()
        switch.close("store")
    except StoreError as exc:
        if not is_outage(exc):
            raise
        switch.open("store", exc)
        await switch.pause(attempt)      # the next probe's delay
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from meshforge.consume.policy import is_outage
from meshforge.errors import one_line
from meshforge.ops.observability import Metrics

__all__ = ["PROBE_DELAYS", "REMIND_EVERY", "KillSwitch", "is_outage"]

log = logging.getLogger("meshforge.killswitch")

#: Seconds between probes: the n-th failed probe waits the n-th entry (then the last).
PROBE_DELAYS = (0.2, 0.5, 1.0, 2.0, 5.0)
#: At most one reminder line this often (seconds) while the switch stays open.
REMIND_EVERY = 60.0


class KillSwitch:
    """One per worker: open while any cause (``store``, ``server``) is out."""

    def __init__(
        self,
        metrics: Metrics | None = None,
        *,
        delays: tuple[float, ...] = PROBE_DELAYS,
        remind_every: float = REMIND_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics or Metrics.default()
        self.delays = delays
        self.remind_every = remind_every
        self._clock = clock
        self._causes: dict[str, tuple[float, str]] = {}  # cause -> (opened at, last error)
        self._reminder: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._closed.set()
        for cause in ("store", "server"):
            self.metrics.kill_switch_open.labels(cause=cause).set(0)
            self.metrics.kill_switch_trips.labels(cause=cause)

    @property
    def paused(self) -> bool:
        """Open: consumers fetch nothing more until it closes."""
        return bool(self._causes)

    @property
    def causes(self) -> list[str]:
        """What is out now (``store``, ``server``)."""
        return sorted(self._causes)

    async def resumed(self) -> None:
        """Until the switch is closed."""
        await self._closed.wait()

    def open(self, cause: str, error: BaseException | str) -> None:
        """``cause`` failed for a reason not the message's: open the switch (one ERROR
        line; a reminder every ``remind_every`` seconds while it stays open)."""
        text = error if isinstance(error, str) else one_line(error, 300)
        held = self._causes.get(cause)
        if held is not None:
            self._causes[cause] = (held[0], text)  # the latest error, for the reminder
            return
        self._causes[cause] = (self._clock(), text)
        self._closed.clear()
        self.metrics.kill_switch_open.labels(cause=cause).set(1)
        self.metrics.kill_switch_trips.labels(cause=cause).inc()
        log.error("kill switch open: the %s is out (%s); fetching paused, held commands kept"
                  " and retried until it answers", cause, text)  # fmt: skip
        if self._reminder is None or self._reminder.done():
            self._reminder = asyncio.get_running_loop().create_task(self._remind())

    def close(self, cause: str) -> None:
        """``cause`` answers again: close (one ERROR line) if it was what kept it open."""
        held = self._causes.pop(cause, None)
        if held is None:
            return
        self.metrics.kill_switch_open.labels(cause=cause).set(0)
        log.error(
            "kill switch closed: the %s answers again after %.1fs; work resumes",
            cause,
            self._clock() - held[0],
        )
        if not self._causes:
            self._closed.set()
            if self._reminder is not None:
                self._reminder.cancel()
                self._reminder = None

    def stop(self) -> None:
        """No more reminders (the worker is stopping, the switch may still be open)."""
        if self._reminder is not None:
            self._reminder.cancel()
            self._reminder = None

    async def _remind(self) -> None:
        while self._causes:
            await asyncio.sleep(self.remind_every)
            now = self._clock()
            for cause, (since, text) in sorted(self._causes.items()):
                log.error(
                    "kill switch still open: the %s has been out for %.0fs (%s)",
                    cause,
                    now - since,
                    text,
                )

    async def pause(self, attempt: int) -> None:
        """Sleep before probe ``attempt`` (1 for the first) of a held transaction."""
        await asyncio.sleep(self.delays[min(max(attempt, 1), len(self.delays)) - 1])
