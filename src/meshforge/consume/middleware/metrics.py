"""Handler run time into ``meshforge_handler_seconds{consumer}``.

The consumer itself counts consumed / acked / naked / dead-lettered messages (those
are decisions, not handler facts); this middleware times the handler.
"""

from __future__ import annotations

import time

from meshforge.consume.decisions import Decision, Delivery, Handler, Middleware
from meshforge.ops.observability import Metrics

__all__ = ["HANDLER_SECONDS", "metrics_middleware"]

#: Seconds the rest of the chain took, set when it returns or raises.
HANDLER_SECONDS = "metrics.handler_seconds"


def metrics_middleware(metrics: Metrics, consumer: str) -> Middleware:
    """Observe each handler run in ``metrics.handler_seconds`` labelled ``consumer``."""
    histogram = metrics.handler_seconds.labels(consumer=consumer)

    async def timed(delivery: Delivery, call_next: Handler) -> Decision | None:
        start = time.perf_counter()
        try:
            return await call_next(delivery)
        finally:
            elapsed = time.perf_counter() - start
            delivery.metadata[HANDLER_SECONDS] = elapsed
            histogram.observe(elapsed)

    return timed
