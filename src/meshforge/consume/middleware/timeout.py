"""Bound a handler's run time: past it, the handler is cancelled and the error is transient.

Example: ``timeout_middleware(10.0)`` (the consumer adds it for ``handler_timeout``).
"""

from __future__ import annotations

import asyncio
import time

from meshforge.consume.decisions import Decision, Delivery, Handler, Middleware

__all__ = ["DEADLINE", "timeout_middleware"]

#: ``time.monotonic()`` by which the handler must finish.
DEADLINE = "timeout.deadline"


def timeout_middleware(seconds: float) -> Middleware:
    """Cancel the rest of the chain after ``seconds``; raises ``TimeoutError`` (a transient
    error: nak with backoff, dead letter on the last attempt)."""
    if seconds <= 0:
        raise ValueError(f"handler timeout: expected seconds > 0, got {seconds!r}")

    async def timeout(delivery: Delivery, call_next: Handler) -> Decision | None:
        delivery.metadata[DEADLINE] = time.monotonic() + seconds
        try:
            async with asyncio.timeout(seconds):
                return await call_next(delivery)
        except TimeoutError:
            raise TimeoutError(f"handler did not finish within {seconds:g}s") from None

    return timeout
