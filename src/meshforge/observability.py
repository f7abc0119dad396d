"""Metrics, logs and tracing hooks.

``Metrics`` holds every Prometheus series MeshForge exports, in its own registry so
several runtimes (and tests) in one process do not collide. Pass one ``Metrics`` to
the publisher, consumer and engine; ``Metrics.default()`` is the process-wide one.

Example::

    metrics = Metrics()
    metrics.published.labels(stream="MESHFORGE_EVENTS").inc()
    print(metrics.render().decode())
"""

from __future__ import annotations

from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """Every series: counters, histograms and gauges, labelled by stream, consumer, reason or kind."""

    _default: ClassVar[Metrics | None] = None

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.published = Counter("meshforge_published", "Messages stored by JetStream.", ["stream"], registry=r)
        self.publish_duplicates = Counter(
            "meshforge_publish_duplicates", "Publishes the server reported as duplicates.", ["stream"], registry=r
        )
        self.publish_retries = Counter(
            "meshforge_publish_retries", "Publish attempts retried, by error kind.", ["kind"], registry=r
        )
        self.publish_failures = Counter(
            "meshforge_publish_failures", "Publishes that failed for good, by error kind.", ["kind"], registry=r
        )
        self.consumed = Counter("meshforge_consumed", "Messages delivered to a consumer.", ["consumer"], registry=r)
        self.acked = Counter("meshforge_acked", "Messages acknowledged.", ["consumer"], registry=r)
        self.naked = Counter("meshforge_naked", "Messages negatively acknowledged.", ["consumer"], registry=r)
        self.redeliveries = Counter(
            "meshforge_redeliveries", "Deliveries after the first.", ["consumer"], registry=r
        )
        self.dead_lettered = Counter(
            "meshforge_dead_lettered", "Messages sent to failed.>, by reason.", ["consumer", "reason"], registry=r
        )
        self.deliveries_exhausted = Counter(
            "meshforge_deliveries_exhausted", "Messages that used up MaxDeliver.", ["consumer"], registry=r
        )
        self.duplicates_skipped = Counter(
            "meshforge_duplicates_skipped", "Deliveries whose effect had already happened.", ["consumer"], registry=r
        )
        self.handler_seconds = Histogram(
            "meshforge_handler_seconds", "Handler run time.", ["consumer"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.end_to_end_seconds = Histogram(
            "meshforge_end_to_end_seconds",
            "From the message's stored time to its ack.",
            ["consumer"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("meshforge_in_flight", "Messages being handled now.", ["consumer"], registry=r)
        self.outbox_depth = Gauge("meshforge_outbox_depth", "Outbox rows not yet sent.", registry=r)

    @classmethod
    def default(cls) -> Metrics:
        """The process-wide instance (created on first use)."""
        if cls._default is None:
            cls._default = cls()
        return cls._default

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)
