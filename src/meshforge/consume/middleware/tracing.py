"""A CONSUMER span per delivery, child of the message's ``traceparent``.

With no OpenTelemetry SDK installed the span records nothing, but the message's trace
becomes the current one, so logs written by the handler carry its ids.
"""

from __future__ import annotations

from meshforge.consume.decisions import Decision, Delivery, Handler, Middleware
from meshforge.ops.observability import consumer_span, current_trace

__all__ = [
    "ATTR_CONSUMER",
    "ATTR_DELIVERIES",
    "ATTR_DESTINATION",
    "ATTR_MESSAGE_ID",
    "ATTR_STREAM_SEQ",
    "ATTR_SYSTEM",
    "SPAN_ID",
    "TRACE_ID",
    "tracing_middleware",
]

#: The current trace and span ids (hex) while the handler runs.
TRACE_ID = "tracing.trace_id"
SPAN_ID = "tracing.span_id"

# OpenTelemetry messaging semantic-convention attribute names.
ATTR_SYSTEM = "messaging.system"
ATTR_DESTINATION = "messaging.destination.name"
ATTR_MESSAGE_ID = "messaging.message.id"
ATTR_CONSUMER = "messaging.consumer.group.name"
ATTR_DELIVERIES = "messaging.nats.delivery_count"
ATTR_STREAM_SEQ = "messaging.nats.stream_sequence"


def tracing_middleware(consumer: str) -> Middleware:
    """Run the rest of the chain inside ``"<subject> process"`` (a CONSUMER span)."""

    async def traced(delivery: Delivery, call_next: Handler) -> Decision | None:
        attributes: dict[str, str | int] = {
            ATTR_SYSTEM: "nats",
            ATTR_DESTINATION: delivery.subject,
            ATTR_CONSUMER: consumer,
            ATTR_DELIVERIES: delivery.num_delivered,
            ATTR_STREAM_SEQ: delivery.seq,
        }
        if delivery.envelope is not None:
            attributes[ATTR_MESSAGE_ID] = delivery.envelope.id
        headers = dict(delivery.headers)
        if "traceparent" not in headers and delivery.envelope is not None:
            # The body's ids stand in when a client sent no header.
            env = delivery.envelope
            if env.trace_id and env.span_id:
                headers["traceparent"] = f"00-{env.trace_id}-{env.span_id}-01"
        with consumer_span(f"{delivery.subject} process", headers, attributes):
            ids = current_trace()
            if ids is not None:
                delivery.metadata[TRACE_ID], delivery.metadata[SPAN_ID] = ids
            return await call_next(delivery)

    return traced
