"""One log line per handler run: debug when it returns, warning when it raises.

Other middlewares may add fields to the line through ``delivery.metadata[LOG_FIELDS]``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from meshforge.consume.decisions import Decision, Delivery, Handler, Middleware
from meshforge.errors import one_line

__all__ = ["LOG_FIELDS", "log_fields", "logging_middleware"]

#: A dict of extra fields for the log line (created on first use).
LOG_FIELDS = "logging.fields"


def log_fields(delivery: Delivery) -> dict[str, Any]:
    """The structured fields that identify a delivery in logs."""
    fields: dict[str, Any] = {
        "consumer": delivery.consumer,
        "subject": delivery.subject,
        "stream": delivery.stream,
        "stream_seq": delivery.seq,
        "deliveries": delivery.num_delivered,
    }
    if delivery.envelope is not None:
        fields["message_id"] = delivery.envelope.id
        fields["message_type"] = delivery.envelope.type
    fields.update(delivery.metadata.get(LOG_FIELDS) or {})
    return fields


def logging_middleware(logger: logging.Logger | None = None) -> Middleware:
    """Log each handler outcome on ``logger`` (default ``meshforge.handler``)."""
    log = logger or logging.getLogger("meshforge.handler")

    async def logged(delivery: Delivery, call_next: Handler) -> Decision | None:
        start = time.perf_counter()
        try:
            decision = await call_next(delivery)
        except Exception as exc:
            if log.isEnabledFor(logging.WARNING):
                fields = log_fields(delivery)
                fields["error"] = one_line(exc, 300)
                fields["seconds"] = round(time.perf_counter() - start, 6)
                log.warning(
                    "handler failed on %s: %s", delivery.subject, fields["error"], extra=fields
                )
            raise
        if log.isEnabledFor(logging.DEBUG):
            fields = log_fields(delivery)
            fields["decision"] = decision.action.value if decision is not None else "ack"
            fields["seconds"] = round(time.perf_counter() - start, 6)
            log.debug("handled %s", delivery.subject, extra=fields)
        return decision

    return logged
