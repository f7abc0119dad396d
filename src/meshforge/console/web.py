"""What every page shares: the console's state, who is asking, forms with CSRF, rendering."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.templating import Jinja2Templates

from meshforge.config import Settings
from meshforge.console.auth import (
    CSRF_FIELD,
    ConsoleTokens,
    Sessions,
    SignInThrottle,
    User,
    cross_site,
    csrf_ok,
    csrf_token,
    current_user,
)
from meshforge.console.status import StatusReader
from meshforge.deadletters.admin import DeadLetters
from meshforge.errors import MeshForgeError, one_line
from meshforge.publish.publisher import Publisher
from meshforge.transport.connection import Connection

__all__ = ["Console", "Handler", "action", "console_of", "page", "render"]

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=str(HERE / "templates"))  # autoescape on for .html

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(slots=True)
class Console:
    """The state of one console process: settings, tokens, sessions, and NATS connection."""

    settings: Settings
    tokens: ConsoleTokens
    tenant: str | None
    reports: Path
    sessions: Sessions
    throttle: SignInThrottle = field(default_factory=SignInThrottle)
    conn: Connection | None = None
    #: The AsyncAPI document of the agents and nodes it was given (None: none given).
    contract: dict[str, Any] | None = None

    @property
    def connection(self) -> Connection:
        if self.conn is None:
            raise MeshForgeError("console: not connected to NATS yet")
        return self.conn

    def letters(self) -> DeadLetters:
        """The same admin API ``meshforge dlq`` uses, bound to the console's tenant (if any)."""
        js = self.connection.js
        return DeadLetters(js, Publisher(js, self.settings), tenant=self.tenant)

    def status(self) -> StatusReader:
        return StatusReader(self.connection, tenant=self.tenant)


def console_of(request: Request) -> Console:
    found: Console = request.app.state.console
    return found


def render(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
    """A template with what every page needs: user, CSRF token, tenant, one flash message."""
    console = console_of(request)
    user: User | None = request.scope.get("meshforge.user")
    flash = request.session.pop("flash", None) if "session" in request.scope else None
    base = {
        "user": user,
        "csrf": csrf_token(request) if user and user.via != "bearer" else "",
        "csrf_field": CSRF_FIELD,
        "tenant": console.tenant,
        "flash": flash,
        "path": request.url.path,
    }
    return templates.TemplateResponse(request, name, {**base, **context}, status_code=status)


def flash(request: Request, message: str) -> None:
    request.session["flash"] = message


def _denied(request: Request, status: int, why: str) -> Response:
    if status == 401 and "text/html" in request.headers.get("accept", ""):
        return RedirectResponse(f"/login?next={request.url.path}", status_code=303)
    return PlainTextResponse(why, status_code=status)


def _failed(request: Request, exc: MeshForgeError) -> Response:
    return render(request, "error.html", {"message": str(exc)}, status=400)


def user_of(request: Request) -> User | None:
    console = console_of(request)
    return current_user(request, console.tokens, console.sessions)


def page(handler: Handler) -> Handler:
    """A read-only page: any signed-in role; MeshForge errors become a one-line error page."""

    async def wrapped(request: Request) -> Response:
        user = user_of(request)
        if user is None:
            return _denied(request, 401, "sign in, or send Authorization: Bearer TOKEN")
        request.scope["meshforge.user"] = user
        try:
            return await handler(request)
        except MeshForgeError as exc:
            return _failed(request, exc)
        except (nats.errors.Error, nats.js.errors.Error) as exc:  # one line, as the CLI shows
            return _failed(request, MeshForgeError(one_line(exc, 300)))

    return wrapped


ActionHandler = Callable[[Request, User, FormData], Awaitable[Response]]


def action(handler: ActionHandler) -> Handler:
    """A POST that changes something: same-site, operator only, CSRF-checked, errors as one line."""

    async def wrapped(request: Request) -> Response:
        if (why := cross_site(request)) is not None:
            return _denied(request, 403, f"forbidden: a cross-site request ({why})")
        user = user_of(request)
        if user is None:
            return _denied(request, 401, "sign in, or send Authorization: Bearer TOKEN")
        if not user.can_act:
            return _denied(request, 403, "forbidden: the viewer role cannot act")
        form = await request.form()
        posted = form.get(CSRF_FIELD)
        if not csrf_ok(request, user, posted if isinstance(posted, str) else None):
            return _denied(request, 403, "forbidden: missing or wrong CSRF token")
        request.scope["meshforge.user"] = user
        try:
            return await handler(request, user, form)
        except MeshForgeError as exc:
            return _failed(request, exc)
        except (nats.errors.Error, nats.js.errors.Error) as exc:  # one line, as the CLI shows
            return _failed(request, MeshForgeError(one_line(exc, 300)))

    return wrapped


def fragment(request: Request) -> bool:
    """Whether htmx asked for a part of the page only."""
    return request.headers.get("hx-request") == "true"


def see_other(url: str) -> Response:
    return RedirectResponse(url, status_code=303)


def html(text: str) -> Response:
    return HTMLResponse(text)
