"""Middlewares: small wrappers around a handler, one per file, each naming its metadata keys.

A middleware is ``async def mw(delivery, call_next) -> Decision | None``; it may look at
or annotate ``delivery.metadata``, call ``call_next(delivery)`` (or not), and return or
raise. The consumer always runs tracing, then logging, then metrics around the user's
middlewares (first given = outermost), and a timeout (when set) closest to the handler.

Example::

    async def audit(delivery: Delivery, call_next: Handler) -> Decision | None:
        delivery.metadata["audit.seen"] = True
        return await call_next(delivery)

    consumer = Consumer(conn, spec, handler=handle, middlewares=[audit])
"""

from __future__ import annotations

from collections.abc import Sequence

from meshforge.consume.decisions import Decision, Delivery, Handler, Middleware
from meshforge.consume.middleware.logging import logging_middleware
from meshforge.consume.middleware.metrics import metrics_middleware
from meshforge.consume.middleware.timeout import timeout_middleware
from meshforge.consume.middleware.tracing import tracing_middleware

__all__ = [
    "chain",
    "logging_middleware",
    "metrics_middleware",
    "timeout_middleware",
    "tracing_middleware",
]


def _link(middleware: Middleware, call_next: Handler) -> Handler:
    async def call(delivery: Delivery) -> Decision | None:
        return await middleware(delivery, call_next)

    return call


def chain(middlewares: Sequence[Middleware], handler: Handler) -> Handler:
    """One handler that runs ``middlewares`` in order (the first is outermost), then ``handler``.

    >>> import asyncio
    >>> order = []
    >>> async def mw(d, nxt): order.append("mw"); return await nxt(d)
    >>> async def h(d): order.append("h")
    >>> asyncio.run(chain([mw], h)(None)); order
    ['mw', 'h']
    """
    call = handler
    for middleware in reversed(middlewares):
        call = _link(middleware, call)
    return call
