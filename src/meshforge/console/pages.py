"""Overview, nodes, pipeline reports, sign-in and the open health check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from meshforge.console import params
from meshforge.console.auth import (
    CSRF_FIELD,
    REPORT_CSP,
    SESSION_FIELD,
    User,
    audit,
    client_of,
    cross_site,
    csrf_matches,
    csrf_token,
    log,
    retry_after,
)
from meshforge.console.web import (
    action,
    console_of,
    fragment,
    page,
    render,
    see_other,
    user_of,
)
from meshforge.control.client import ControlClient, to_timestamp
from meshforge.errors import ConfigError, MeshForgeError
from meshforge.topology.subjects import validate_token

__all__ = ["routes"]

# How long a send waits for the node's reply before the page polls for it.
REPLY_WAIT = 5.0
MAX_REPORTS = 20
MAX_TOKEN = 1024  # longer than any token worth trying: refused unread


async def healthz(request: Request) -> Response:
    conn = console_of(request).conn
    ok = conn is not None and conn.nc.is_connected
    return JSONResponse({"ok": ok}, status_code=200 if ok else 503)


@page
async def overview(request: Request) -> Response:
    view = await console_of(request).status().overview()
    name = "_overview.html" if fragment(request) else "overview.html"
    return render(request, name, {"view": view})


@page
async def nodes(request: Request) -> Response:
    found = await console_of(request).status().nodes()
    name = "_nodes.html" if fragment(request) else "nodes.html"
    return render(request, name, {"nodes": found})


def _node_of(request: Request, target: str | None = None) -> tuple[str, str]:
    """The ``site/node`` of the path (or of the form's ``target``)."""
    if console_of(request).tenant is not None:
        raise MeshForgeError("nodes belong to sites, not tenants: this console is bound to one")
    if target is not None:
        site, _, node = target.partition("/")
    else:
        site, node = request.path_params["site"], request.path_params["node"]
    return validate_token(site, "site"), validate_token(node, "node")


def _payload(text: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"payload: expected a JSON object, got invalid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError('payload: expected a JSON object such as {"seconds": 1}')
    return value


def _text(form: FormData, name: str, limit: int = 4096) -> str:
    value = form.get(name)
    return params.text(value if isinstance(value, str) else None, name, limit=limit)


def _deadline(text: str) -> str | None:
    """The send's deadline checked here: a delay too far away is a 400, not an overflow."""
    if not text:
        return None
    try:
        to_timestamp(text, what="deadline")
    except (OverflowError, ValueError):
        raise params.BadInput(f"deadline: {text[:40]!r} is out of range") from None
    return text


@action
async def send(request: Request, user: User, form: FormData) -> Response:
    site, node = _node_of(request, _text(form, "target", 200))
    command = validate_token(_text(form, "command", 200), "command")
    payload_text = _text(form, "payload", 64 * 1024)
    payload = _payload(payload_text)
    deadline = _deadline(_text(form, "deadline", 64))
    if _text(form, "confirm") != "yes":
        context: dict[str, Any] = {
            "what": f"Send {command} to {site}/{node}",
            "count": None,
            "detail": json.dumps(payload),
            "target": "/nodes/send",
            "fields": {
                "target": f"{site}/{node}",
                "command": command,
                "payload": payload_text,
                "deadline": deadline or "",
                "confirm": "yes",
            },
        }
        return render(request, "confirm.html", context)
    conn = console_of(request).connection
    client = ControlClient(conn, settings=console_of(request).settings, source="console")
    command_id = await client.send(site, node, command, payload, deadline=deadline)
    audit(user, f"sent {command} {json.dumps(payload)} to {site}/{node} (id {command_id})")
    reply = await client.wait_reply(site, node, command_id, REPLY_WAIT)
    context = {"site": site, "node": node, "command": command, "id": command_id, "reply": reply}
    return render(request, "sent.html", context)


@page
async def reply(request: Request) -> Response:
    site, node = _node_of(request)
    command_id = validate_token(request.path_params["command_id"], "command id")
    found = await ControlClient(console_of(request).connection).find_reply(site, node, command_id)
    context = {"site": site, "node": node, "id": command_id, "reply": found}
    return render(request, "_reply.html", context)


def _found(root: Path, tenant: str | None) -> list[tuple[Path, dict[str, Any]]]:
    """The audit reports under ``root``, newest first, with their findings; for a console
    bound to a tenant only those whose ``audit.json`` names that tenant."""
    if not root.is_dir():
        return []
    found = sorted(root.glob("**/audit.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    reports = []
    for path in found:
        try:
            findings = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            findings = {}
        if not isinstance(findings, dict):
            findings = {}
        if tenant is not None and findings.get("tenant") != tenant:
            continue  # a report of every tenant, or another's: not this console's to show
        reports.append((path, findings))
    return reports


def _reports(root: Path, tenant: str | None) -> list[dict[str, Any]]:
    """The newest audit reports (``audit.json`` beside its ``audit.html``) as the list shows them."""
    return [
        {
            "index": index,
            "path": str(path.parent.relative_to(root)),
            "ok": bool(findings.get("ok")),
            "generated": findings.get("generated_at", ""),
            "html": (path.parent / "audit.html").is_file(),
        }
        for index, (path, findings) in enumerate(_found(root, tenant)[:MAX_REPORTS])
    ]


@page
async def pipeline(request: Request) -> Response:
    console = console_of(request)
    context = {
        "reports": _reports(console.reports, console.tenant),
        "root": str(console.reports),
        "bound": console.tenant,
    }
    return render(request, "pipeline.html", context)


@page
async def report(request: Request) -> Response:
    console = console_of(request)
    index = params.number(request.path_params["index"], "report", high=MAX_REPORTS - 1)
    found = _found(console.reports, console.tenant)[:MAX_REPORTS]
    if index >= len(found) or not (found[index][0].parent / "audit.html").is_file():
        return PlainTextResponse("no such report", status_code=404)
    response = FileResponse(found[index][0].parent / "audit.html", media_type="text/html")
    response.headers["Content-Security-Policy"] = REPORT_CSP
    return response


def _refused(request: Request, status: int, why: str, shown: str, **more: str) -> Response:
    """A refused sign-in: one line on the audit log, and the form again with ``shown``."""
    log.warning("console sign-in refused from %s: %s", client_of(request), why)
    target = _next(request)
    context = {"next": target, "error": shown, "csrf": csrf_token(request)}
    response = render(request, "login.html", context, status)
    response.headers.update(more)
    return response


def _next(request: Request) -> str:
    target = request.query_params.get("next", "/")
    if len(target) > 2048 or not target.startswith("/") or target.startswith("//"):
        return "/"  # only paths of this console: no open redirect
    return target


async def login(request: Request) -> Response:
    console = console_of(request)
    target = _next(request)
    if not console.tokens.configured:
        return see_other(target)  # no token to give: the local user is already in
    if request.method == "GET":
        return render(
            request, "login.html", {"next": target, "error": "", "csrf": csrf_token(request)}
        )
    if (why := cross_site(request)) is not None:
        return _refused(request, 403, f"a cross-site request ({why})", "refused: cross-site")
    client = client_of(request)
    wait = console.throttle.wait(client)
    if wait > 0:
        return _refused(
            request,
            429,
            f"too many wrong tokens, next try in {retry_after(wait)}s",
            f"too many wrong tokens: try again in {retry_after(wait)} s",
            **{"Retry-After": retry_after(wait)},
        )
    form = await request.form()
    if not csrf_matches(request, form.get(CSRF_FIELD)):
        return _refused(request, 403, "missing or wrong CSRF token", "the form expired: try again")
    token = form.get("token")
    token = token.strip() if isinstance(token, str) and len(token) <= MAX_TOKEN else ""
    name = form.get("name")
    name = name.strip()[:64] if isinstance(name, str) else ""
    role = console.tokens.role_of(token) if token else None
    if role is None:
        count, wait = console.throttle.failed(client)
        why = f"wrong token ({count} in a row; next try in {retry_after(wait)}s)"
        return _refused(request, 401, why, "wrong token")
    console.throttle.succeeded(client)
    console.sessions.end(request.session.get(SESSION_FIELD))
    request.session.clear()  # a new session id and a new CSRF token: nothing carried over
    request.session[SESSION_FIELD] = console.sessions.start(role, name or role)
    audit(User(role, "session", name or role, client), "signed in")
    return see_other(target)


async def logout(request: Request) -> Response:
    """Ends the session on the server: a copy of the cookie reads nothing afterwards."""
    if (why := cross_site(request)) is not None:
        return PlainTextResponse(f"forbidden: a cross-site request ({why})", status_code=403)
    form = await request.form()
    user = user_of(request)
    if user is not None and user.via == "session":
        if not csrf_matches(request, form.get(CSRF_FIELD)):
            return PlainTextResponse("forbidden: missing or wrong CSRF token", status_code=403)
        audit(user, "signed out")
    console_of(request).sessions.end(request.session.get(SESSION_FIELD))
    request.session.clear()
    return see_other("/login")


routes = [
    Route("/healthz", healthz),
    Route("/", overview),
    Route("/nodes", nodes),
    Route("/nodes/send", send, methods=["POST"]),
    Route("/nodes/{site}/{node}/replies/{command_id}", reply),
    Route("/pipeline", pipeline),
    Route("/pipeline/{index}", report),
    Route("/login", login, methods=["GET", "POST"]),
    Route("/logout", logout, methods=["POST"]),
]
