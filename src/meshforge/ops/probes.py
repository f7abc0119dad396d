"""Periodic probes: consumer lag from the server, inbox size from the store, into ``Metrics``.

The consumer counters (acked, naked, ...) say what one process did; how far behind a
durable consumer is only the server knows. ``Probes`` asks it every ``interval`` seconds
(``$JS.API.CONSUMER.INFO.<stream>.<durable>``, the same request the start-up check uses)
and sets ``meshforge_consumer_pending`` / ``_ack_pending`` / ``_redelivered``; with a
store it also counts the inbox rows by status (``meshforge_inbox_rows``).

Example::

    probes = Probes(conn.js, metrics, [("MESHFORGE_COMMANDS", "order_consumer")], store=store)
    task = asyncio.create_task(probes.run(interval=15))
    ...
    task.cancel()
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshforge.errors import one_line
from meshforge.ops.observability import Metrics
from meshforge.store.sequencing import IS_PUBLISHED

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from prometheus_client import Gauge

    from meshforge.store.base import Store, Transaction

__all__ = ["DEFAULT_PROBE_INTERVAL", "Probes"]

log = logging.getLogger("meshforge.probes")

DEFAULT_PROBE_INTERVAL = 15.0
_INFO_TIMEOUT = 2.0
_INBOX_COUNT = "SELECT status, COUNT(*) FROM meshforge_inbox GROUP BY status"
# An effect is published when a published run covers its sequence (docs/STORE.md).
_EFFECTS_COUNT = (
    f"SELECT CASE WHEN {IS_PUBLISHED} THEN 'published' ELSE 'unpublished' END AS state,"
    " COUNT(*) FROM meshforge_effects e GROUP BY state"
)


class Probes:
    """Samples consumer info (and the inbox) into gauges; a failed sample is logged once."""

    def __init__(
        self,
        js: JetStreamContext,
        metrics: Metrics,
        consumers: Sequence[tuple[str, str]],
        *,
        store: Store | None = None,
    ) -> None:
        self.js = js
        self.metrics = metrics
        self.consumers = list(consumers)
        self.store = store
        self._failing: set[str] = set()
        self._statuses: set[str] = set()
        self._effect_states: set[str] = set()

    async def sample(self) -> None:
        """One round: every consumer's info, then the inbox count."""
        for stream, durable in self.consumers:
            try:
                info = await asyncio.wait_for(self.js.consumer_info(stream, durable), _INFO_TIMEOUT)
            except Exception as exc:  # disconnected, denied, deleted: keep the last values
                self._failed(f"consumer {stream}/{durable}", exc)
                continue
            self._recovered(f"consumer {stream}/{durable}")
            labels = {"stream": stream, "consumer": durable}
            self.metrics.consumer_pending.labels(**labels).set(info.num_pending or 0)
            self.metrics.consumer_ack_pending.labels(**labels).set(info.num_ack_pending or 0)
            self.metrics.consumer_redelivered.labels(**labels).set(info.num_redelivered or 0)
        if self.store is not None:
            await self._sample_inbox(self.store)

    async def _sample_inbox(self, store: Store) -> None:
        def count(tx: Transaction) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
            return tx.execute(_INBOX_COUNT), tx.execute(_EFFECTS_COUNT)

        try:
            inbox, effects = await asyncio.to_thread(store.run, count)
        except Exception as exc:  # a busy or missing store must not stop the worker
            self._failed("inbox count", exc)
            return
        self._recovered("inbox count")
        self._set(self.metrics.inbox_rows, inbox, self._statuses)
        self._set(self.metrics.effects_rows, effects, self._effect_states)

    @staticmethod
    def _set(gauge: Gauge, rows: list[tuple[object, ...]], known: set[str]) -> None:
        seen = {str(status): int(str(n)) for status, n in rows}
        # A status that emptied reads 0 rather than keeping its last count.
        for status in known | set(seen):
            gauge.labels(status=status).set(seen.get(status, 0))
        known |= set(seen)

    async def run(self, interval: float = DEFAULT_PROBE_INTERVAL) -> None:
        """Sample every ``interval`` seconds until cancelled."""
        while True:
            await self.sample()
            await asyncio.sleep(interval)  # the probe period

    def _failed(self, what: str, exc: BaseException) -> None:
        if what not in self._failing:
            self._failing.add(what)
            log.warning("probe: reading %s failed: %s", what, one_line(exc, 300))

    def _recovered(self, what: str) -> None:
        if what in self._failing:
            self._failing.discard(what)
            log.info("probe: reading %s works again", what)
