"""What a worker handled, logged as one summary line a second at most, never a line per command.

The counts come from the worker's own metrics, so the hot path does nothing more::

    handled 42 command(s) in 1.0s (42/s): order 30 ok, 1 duplicate; inventory 11 ok, 1 dead-lettered (unrecoverable)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from meshforge.ops.observability import Metrics

__all__ = ["Totals", "summarize", "totals"]

log = logging.getLogger("meshforge.activity")

#: Per consumer: acked, duplicates skipped, retries (nak), and dead letters by reason.
Totals = dict[str, dict[str, float]]


def totals(metrics: Metrics, durables: Sequence[str]) -> Totals:
    """The counters of ``durables`` as they stand now."""
    wanted = set(durables)
    out: Totals = {d: {} for d in durables}
    names = {
        "meshforge_acked": "acked", "meshforge_duplicates_skipped": "duplicate",
        "meshforge_naked": "retried", "meshforge_dead_lettered": "dead",
    }  # fmt: skip
    for family in metrics.registry.collect():
        kind = names.get(family.name)
        if kind is None:
            continue
        for sample in family.samples:
            consumer = sample.labels.get("consumer", "")
            if consumer not in wanted or not sample.name.endswith("_total"):
                continue
            key = f"dead:{sample.labels['reason']}" if kind == "dead" else kind
            out[consumer][key] = out[consumer].get(key, 0.0) + sample.value
    return out


def describe(before: Totals, after: Totals, seconds: float, names: dict[str, str]) -> str | None:
    """The summary line for what changed between two readings, or None when nothing did."""
    parts, handled = [], 0
    for consumer, now in after.items():
        delta = {k: int(v - before.get(consumer, {}).get(k, 0.0)) for k, v in now.items()}
        dead = {k[5:]: n for k, n in delta.items() if k.startswith("dead:") and n}
        # A dead letter is acked too, and a duplicate is acked without running the handler.
        ok = delta.get("acked", 0) - sum(dead.values()) - delta.get("duplicate", 0)
        bits = [f"{ok} ok"] if ok > 0 else []
        if delta.get("duplicate"):
            bits.append(f"{delta['duplicate']} duplicate")
        if delta.get("retried"):
            bits.append(f"{delta['retried']} to retry")
        if dead:
            reasons = ", ".join(f"{n} {r}" for r, n in sorted(dead.items()))
            bits.append(f"{sum(dead.values())} dead-lettered ({reasons})")
        if bits:
            handled += max(ok, 0) + delta.get("duplicate", 0) + sum(dead.values())
            parts.append(f"{names.get(consumer, consumer)} {', '.join(bits)}")
    if not parts:
        return None
    return (
        f"handled {handled} command(s) in {seconds:.1f}s ({handled / seconds:.0f}/s): "
        + "; ".join(parts)
    )


async def summarize(
    metrics: Metrics, durables: dict[str, str], stop: asyncio.Event, interval: float = 1.0
) -> None:
    """Until ``stop``: every ``interval`` log what ``durables`` (durable -> agent) handled."""
    if not log.isEnabledFor(logging.INFO):
        return
    before, since = totals(metrics, list(durables)), time.monotonic()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
        after, now = totals(metrics, list(durables)), time.monotonic()
        line = describe(before, after, max(now - since, 1e-3), durables)
        if line:
            log.info("%s", line)
        before, since = after, now
