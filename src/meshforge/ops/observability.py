"""Metrics, logs and tracing hooks, and the /healthz /readyz /metrics endpoint.

``Metrics`` holds every Prometheus series MeshForge exports, in its own registry so
several runtimes (and tests) in one process do not collide. Pass one ``Metrics`` to
the publisher, consumer and engine; ``Metrics.default()`` is the process-wide one.
``configure_logging`` sets up (JSON) logs whose records carry the current trace and
span ids; ``consumer_span`` / ``inject_trace`` carry W3C trace context through message
headers with opentelemetry-api (a no-op without an SDK); ``serve_http`` exposes health,
readiness and metrics over HTTP.

Example::

    metrics = Metrics()
    metrics.published.labels(stream="MESHFORGE_EVENTS").inc()
    print(metrics.render().decode())
    configure_logging("INFO", json=True)
    endpoint = await serve_http("127.0.0.1", 9100, metrics, conn.health, lambda: True)
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import errno
import json as jsonlib
import logging
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping, Sequence
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, ClassVar

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from meshforge.envelope import format_traceparent, parse_traceparent
from meshforge.errors import MeshForgeError, one_line

__all__ = [
    "EndpointError",
    "HttpEndpoint",
    "JsonFormatter",
    "Metrics",
    "TraceFilter",
    "bind_trace",
    "configure_logging",
    "consumer_span",
    "current_trace",
    "extract_context",
    "inject_trace",
    "observe_many",
    "serve_http",
]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """Every series: counters, histograms and gauges, labelled by stream, consumer, reason or kind."""

    _default: ClassVar[Metrics | None] = None

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.published = Counter(
            "meshforge_published", "Messages stored by JetStream.", ["stream"], registry=r
        )
        self.publish_duplicates = Counter(
            "meshforge_publish_duplicates",
            "Publishes the server reported as duplicates.",
            ["stream"],
            registry=r,
        )
        self.publish_retries = Counter(
            "meshforge_publish_retries",
            "Publish attempts retried, by error kind.",
            ["kind"],
            registry=r,
        )
        self.publish_failures = Counter(
            "meshforge_publish_failures",
            "Publishes that failed for good, by error kind.",
            ["kind"],
            registry=r,
        )
        self.consumed = Counter(
            "meshforge_consumed", "Messages delivered to a consumer.", ["consumer"], registry=r
        )
        self.acked = Counter("meshforge_acked", "Messages acknowledged.", ["consumer"], registry=r)
        self.naked = Counter(
            "meshforge_naked", "Messages negatively acknowledged.", ["consumer"], registry=r
        )
        self.redeliveries = Counter(
            "meshforge_redeliveries", "Deliveries after the first.", ["consumer"], registry=r
        )
        self.dead_lettered = Counter(
            "meshforge_dead_lettered",
            "Messages sent to failed.>, by reason.",
            ["consumer", "reason"],
            registry=r,
        )
        self.deliveries_exhausted = Counter(
            "meshforge_deliveries_exhausted",
            "Messages that used up MaxDeliver.",
            ["consumer"],
            registry=r,
        )
        self.duplicates_skipped = Counter(
            "meshforge_duplicates_skipped",
            "Deliveries whose effect had already happened.",
            ["consumer"],
            registry=r,
        )
        self.handler_seconds = Histogram(
            "meshforge_handler_seconds",
            "Handler run time.",
            ["consumer"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.end_to_end_seconds = Histogram(
            "meshforge_end_to_end_seconds",
            "From the message's stored time to its ack.",
            ["consumer"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.held_back = Counter(
            "meshforge_held_back", "Deliveries nak'ed to wait for an earlier command of their resource.",
            ["consumer"], registry=r,
        )  # fmt: skip
        self.held_commands = Gauge(
            "meshforge_held_commands", "Commands waiting for an earlier command of their resource.",
            ["consumer"], registry=r,
        )  # fmt: skip
        self.oldest_hold_seconds = Gauge(
            "meshforge_oldest_hold_seconds", "How long the oldest held command has been waiting.",
            ["consumer"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "meshforge_in_flight", "Messages being handled now.", ["consumer"], registry=r
        )
        self.outbox_depth = Gauge("meshforge_outbox_depth", "Outbox rows not yet sent.", registry=r)
        # Polled from the server's consumer info (see meshforge.ops.probes), not counted locally.
        self.consumer_pending = Gauge(
            "meshforge_consumer_pending",
            "Messages stored for the consumer and not yet delivered (num_pending).",
            ["stream", "consumer"],
            registry=r,
        )
        self.consumer_ack_pending = Gauge(
            "meshforge_consumer_ack_pending",
            "Messages delivered and not yet acked (num_ack_pending).",
            ["stream", "consumer"],
            registry=r,
        )
        self.consumer_redelivered = Gauge(
            "meshforge_consumer_redelivered",
            "Unacked messages delivered more than once (num_redelivered).",
            ["stream", "consumer"],
            registry=r,
        )
        self.inbox_rows = Gauge(
            "meshforge_inbox_rows",
            "Inbox rows kept in the store, by status.",
            ["status"],
            registry=r,
        )
        self.effects_rows = Gauge(
            "meshforge_effects_rows",
            "Agents' stored effects (idempotency keys), published or not yet.",
            ["status"],
            registry=r,
        )
        self.node_commands = Counter(
            "meshforge_node_commands",
            "Commands a node took from its mailbox, by command type.",
            ["site", "node", "command"],
            registry=r,
        )
        self.node_replies = Counter(
            "meshforge_node_replies",
            "Replies a node sent, by status.",
            ["site", "node", "status"],
            registry=r,
        )
        self.node_epoch = Gauge(
            "meshforge_node_epoch", "A node's current epoch.", ["site", "node"], registry=r
        )
        # Set by a job controller (meshforge ctl job run) after each of its steps.
        self.job_nodes = Gauge(
            "meshforge_job_nodes", "A job's nodes, by state.", ["job_name", "state"], registry=r
        )
        self.job_failed_share = Gauge(
            "meshforge_job_failed_share",
            "Share (0..1) of a job's done nodes that failed.",
            ["job_name"],
            registry=r,
        )
        self.job_oldest_in_progress = Gauge(
            "meshforge_job_oldest_in_progress_seconds",
            "Age of a job's oldest command sent and not yet answered (0: none).",
            ["job_name"],
            registry=r,
        )
        self.ready = Gauge(
            "meshforge_ready", "1 while the process consumes and is connected to NATS.", registry=r
        )
        self.nats_connected = Gauge(
            "meshforge_nats_connected", "1 while connected to NATS.", registry=r
        )
        self.kill_switch_open = Gauge(
            "meshforge_kill_switch_open",
            "1 while an outage (of the store or the server) pauses the work, by cause.",
            ["cause"],
            registry=r,
        )
        self.kill_switch_trips = Counter(
            "meshforge_kill_switch_trips",
            "Times an outage opened the kill switch, by cause.",
            ["cause"],
            registry=r,
        )

    @classmethod
    def default(cls) -> Metrics:
        """The process-wide instance (created on first use)."""
        if cls._default is None:
            cls._default = cls()
        return cls._default

    def prepare_consumer(self, consumer: str, reasons: Sequence[str] = ()) -> None:
        """Export a consumer's series at 0 before its first message, so ``increase()`` in an
        alert sees the first dead letter (a series born at 1 shows no increase)."""
        for counter in (
            self.consumed, self.acked, self.naked, self.redeliveries,
            self.deliveries_exhausted, self.duplicates_skipped,
        ):  # fmt: skip
            counter.labels(consumer=consumer)
        self.in_flight.labels(consumer=consumer)
        for reason in reasons:
            self.dead_lettered.labels(consumer=consumer, reason=reason)

    def track(self, ready: Callable[[], bool], connected: Callable[[], bool]) -> None:
        """Make ``meshforge_ready`` and ``meshforge_nats_connected`` read these at each scrape."""
        self.ready.set_function(lambda: 1.0 if _safe(ready) else 0.0)
        self.nats_connected.set_function(lambda: 1.0 if _safe(connected) else 0.0)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)


def observe_many(histogram: Histogram, amounts: Sequence[float]) -> None:
    """``histogram.observe`` each of ``amounts`` (a labelled child): the same sum and bucket
    counts, with one increment per bucket touched instead of two per amount (a batch of
    acks records its latencies at once)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:  # another prometheus_client
        for amount in amounts:
            histogram.observe(amount)
        return
    # observe() counts an amount in the first bucket whose bound is >= it.
    counts = collections.Counter([bisect.bisect_left(bounds, amount) for amount in amounts])
    total.inc(sum(amounts))
    for index, count in counts.items():
        if index < len(buckets):
            buckets[index].inc(count)


def _safe(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:  # a failing check reads as false, never as a failed scrape
        return False


# ------------------------------------------------------------------ trace context
# A message's trace ids when no OpenTelemetry span carries them (e.g. a decode failure).
_bound_trace: ContextVar[tuple[str, str] | None] = ContextVar("meshforge_trace", default=None)
_TRACER_NAME = "meshforge"


def current_trace() -> tuple[str, str] | None:
    """``(trace_id, span_id)`` as 32 and 16 hex digits: the current valid span's, else the
    ids bound with ``bind_trace``, else None."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
    return _bound_trace.get()


@contextlib.contextmanager
def bind_trace(trace_id: str | None, span_id: str | None) -> Iterator[None]:
    """Make log records inside the block carry these ids (when no span is current)."""
    token = _bound_trace.set((trace_id, span_id) if trace_id and span_id else None)
    try:
        yield
    finally:
        _bound_trace.reset(token)


def extract_context(headers: Mapping[str, str] | None) -> Any:
    """The OpenTelemetry context carried by message headers (``traceparent``)."""
    carrier = {k.lower(): v for k, v in (headers or {}).items()}
    return propagate.extract(carrier)


def inject_trace(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Write the current span's ``traceparent`` into ``headers`` (when a span is current).

    Example: ``headers = inject_trace(dict(env.headers()))`` before publishing.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if parse_traceparent(carrier.get("traceparent")):
        headers.update(carrier)
    elif (bound := _bound_trace.get()) is not None:
        headers["traceparent"] = format_traceparent(*bound)
    return headers


@contextlib.contextmanager
def consumer_span(
    name: str, headers: Mapping[str, str] | None, attributes: Mapping[str, Any] | None = None
) -> Iterator[Span]:
    """A CONSUMER span around a handler, child of the message's ``traceparent``.

    Without an OpenTelemetry SDK the span records nothing, but it still makes the
    message's trace the current one, so logs inside carry its ids.

    Example::

        with consumer_span("cmd.default.demo.order.create process", msg.headers):
            await handler(delivery)
    """
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        # No SDK installed: a span would record nothing, so only bind the ids for logs.
        value = next((v for k, v in (headers or {}).items() if k.lower() == "traceparent"), None)
        ids = parse_traceparent(value)
        with bind_trace(*(ids or (None, None))):
            yield trace.INVALID_SPAN
        return
    tracer = trace.get_tracer(_TRACER_NAME)
    with tracer.start_as_current_span(
        name,
        context=extract_context(headers),
        kind=SpanKind.CONSUMER,
        attributes=dict(attributes or {}),
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except BaseException as exc:
            if span.is_recording():
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise


# ------------------------------------------------------------------------ logging
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class TraceFilter(logging.Filter):
    """Puts ``trace_id`` and ``span_id`` (or None) on every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        ids = current_trace()
        if not hasattr(record, "trace_id") or record.trace_id is None:
            record.trace_id = ids[0] if ids else None
        if not hasattr(record, "span_id") or record.span_id is None:
            record.span_id = ids[1] if ids else None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, trace_id, span_id, extras."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "trace_id": getattr(record, "trace_id", None),
            "span_id": getattr(record, "span_id", None),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return jsonlib.dumps(out, default=str, ensure_ascii=False)


_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [trace=%(trace_id)s] %(message)s"


def configure_logging(
    level: str | int = "INFO", json: bool = False, *, stream: Any = None
) -> logging.Handler:
    """Send logs to stderr (or ``stream``), as JSON lines when ``json``; every record
    carries ``trace_id``/``span_id``. Replaces the handler a previous call installed.

    Example: ``configure_logging(settings.log_level, settings.log_json)``
    """
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_meshforge", False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler._meshforge = True  # type: ignore[attr-defined]  # marks our own handler
    handler.addFilter(TraceFilter())
    handler.setFormatter(JsonFormatter() if json else logging.Formatter(_TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler


# ------------------------------------------------------------- the HTTP endpoint
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
_READ_TIMEOUT = 5.0
_log = logging.getLogger("meshforge.observability")


class EndpointError(MeshForgeError):
    """The health and metrics endpoint cannot listen (port in use, unknown host)."""


class HttpEndpoint:
    """A running /healthz /readyz /metrics server; ``port`` is the bound port."""

    def __init__(self, server: asyncio.Server) -> None:
        self._server = server
        bound = server.sockets[0].getsockname()
        self.host: str = bound[0]
        self.port: int = bound[1]

    async def close(self) -> None:
        """Stop listening and close open connections."""
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2.0)


def _healthy(report: Mapping[str, Any]) -> bool:
    if "ok" in report:
        return bool(report["ok"])
    return bool(report.get("state", "connected") == "connected")


async def serve_http(
    host: str,
    port: int,
    metrics: Metrics,
    health: Callable[[], Awaitable[dict[str, Any]]],
    ready: Callable[[], bool],
) -> HttpEndpoint:
    """Serve ``/healthz`` (JSON from ``health()``; 503 when it has ``ok: false`` or a
    ``state`` other than ``connected``), ``/readyz`` (200 when ``ready()``, else 503) and
    ``/metrics`` (Prometheus text). Port 0 picks a free port. A port in use (or a host
    that cannot be bound) raises ``EndpointError`` with one line.

    Example::

        endpoint = await serve_http("127.0.0.1", 9100, metrics, conn.health, consumer.ready.is_set)
        ...
        await endpoint.close()
    """

    async def answer(path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, metrics.render()
        if path == "/healthz":
            try:
                report = dict(await health())
                code = 200 if _healthy(report) else 503
            except Exception as exc:  # a failing check is an unhealthy answer, not a crash
                report, code = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, 503
            body = jsonlib.dumps(report, default=str).encode()
            return code, "application/json", body
        if path == "/readyz":
            try:
                is_ready = bool(ready())
            except Exception:  # same: not ready
                is_ready = False
            body = jsonlib.dumps({"ready": is_ready}).encode()
            return (200 if is_ready else 503), "application/json", body
        return 404, "text/plain; charset=utf-8", b"not found\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_READ_TIMEOUT):
                request = await reader.readline()
                while await reader.readline() not in (b"\r\n", b"\n", b""):
                    pass  # headers are not needed
            parts = request.decode("latin-1").split()
            if len(parts) < 2:
                return
            method, path = parts[0], parts[1].split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                code, ctype, body = 405, "text/plain; charset=utf-8", b"method not allowed\n"
            else:
                code, ctype, body = await answer(path)
            head = (
                f"HTTP/1.1 {code} {_REASONS.get(code, 'Error')}\r\n"
                f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            ).encode("latin-1")
            writer.write(head + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:  # one bad request must not stop the endpoint
            _log.exception("http endpoint: request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    try:
        server = await asyncio.start_server(handle, host, port)
    except OSError as exc:
        why = "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or one_line(exc))
        raise EndpointError(
            f"cannot serve /healthz /readyz /metrics on {host}:{port}: {why}; "
            "choose another --metrics-port (0 picks a free one)"
        ) from None
    return HttpEndpoint(server)
