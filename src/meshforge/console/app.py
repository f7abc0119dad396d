"""The console's ASGI app: routes, sessions, security headers, and its one NATS connection.

Example::

    app = create_app(load_settings(), nats_url="nats://127.0.0.1:4222")
    uvicorn.run(app, host="127.0.0.1", port=8222)
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshforge.config import Settings
from meshforge.console import contract, jobs, letters, pages
from meshforge.console.auth import (
    CSP,
    SECURITY_HEADERS,
    SESSION_LIFETIME,
    Clock,
    ConsoleTokens,
    Sessions,
    SignInThrottle,
)
from meshforge.console.web import HERE, Console
from meshforge.contract import asyncapi
from meshforge.control.node import Node
from meshforge.runtime.agent import Agent
from meshforge.transport.connection import connect

__all__ = ["create_app"]

log = logging.getLogger("meshforge.console")

DEFAULT_REPORTS = Path(".meshforge/pipeline")
_LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "::1", "[::1]"]


class SecurityHeaders:
    """Adds the CSP and the other security headers to every response that lacks them, and
    answers an unexpected error itself (a plain 500, the trace in the log only), so that
    answer carries them too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                wanted = {"Content-Security-Policy": CSP, **SECURITY_HEADERS}
                for name, value in wanted.items():
                    if name.lower().encode() not in present:
                        headers.append((name.lower().encode(), value.encode()))
                message["headers"] = headers
                started.append(True)
            await send(message)

        started: list[bool] = []
        try:
            await self.app(scope, receive, with_headers)
        except Exception:
            log.exception("console: %s %s failed", scope.get("method"), scope.get("path"))
            if started:
                raise  # the answer is under way: the server can only cut it short
            body = b"internal error: the console logged it\n"
            await with_headers(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})


def create_app(
    settings: Settings,
    *,
    nats_url: str,
    tokens: ConsoleTokens | None = None,
    reports: Path = DEFAULT_REPORTS,
    https_only: bool = False,
    throttle: SignInThrottle | None = None,
    clock: Clock | None = None,
    agents: Sequence[Agent[Any]] = (),
    nodes: Sequence[Node] = (),
) -> Starlette:
    """The console for the server at ``nats_url``; bound to ``settings.tenant`` when set.

    ``agents`` and ``nodes`` are what its Contract page shows (nodes only when it is not
    bound to a tenant: they belong to sites). ``throttle`` and ``clock`` (the sessions'
    time, monotonic seconds) are for tests.
    """
    tokens = tokens if tokens is not None else ConsoleTokens.from_settings(settings)
    sessions = Sessions(idle=settings.console_session_idle, clock=clock or time.monotonic)
    console = Console(
        settings, tokens, settings.tenant, reports, sessions, throttle or SignInThrottle()
    )
    shown_nodes = nodes if settings.tenant is None else ()
    if agents or shown_nodes:
        console.contract = asyncapi(agents, shown_nodes, tenant=settings.tenant)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        console.conn = await connect(settings, url=nats_url, name="meshforge-console")
        try:
            yield
        finally:
            conn, console.conn = console.conn, None
            await conn.close()

    middleware = [Middleware(SecurityHeaders)]
    if not tokens.configured:
        # Open to its local user only: a page of another site resolving to 127.0.0.1
        # (DNS rebinding) names another host and is refused.
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=_LOOPBACK_HOSTS))
    middleware.append(
        Middleware(
            SessionMiddleware,
            secret_key=secrets.token_urlsafe(32),  # sessions end with the process
            session_cookie="meshforge_console",
            same_site="strict",
            https_only=https_only,
            max_age=int(SESSION_LIFETIME),
        )
    )
    routes = [
        *pages.routes,
        *letters.routes,
        *jobs.routes,
        *contract.routes,
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.console = console
    return app
