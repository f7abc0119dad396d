"""Overview, nodes, pipeline reports, sign-in and the open health check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from meshforge.console.auth import REPORT_CSP, User, audit, client_of
from meshforge.console.web import action, console_of, fragment, page, render, see_other
from meshforge.control.client import ControlClient
from meshforge.errors import ConfigError, MeshForgeError
from meshforge.topology.subjects import validate_token

__all__ = ["routes"]

# How long a send waits for the node's reply before the page polls for it.
REPLY_WAIT = 5.0
MAX_REPORTS = 20


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


def _text(form: FormData, name: str) -> str:
    value = form.get(name)
    return value.strip() if isinstance(value, str) else ""


@action
async def send(request: Request, user: User, form: FormData) -> Response:
    site, node = _node_of(request, _text(form, "target"))
    command = validate_token(_text(form, "command"), "command")
    payload_text = _text(form, "payload")
    payload = _payload(payload_text)
    deadline = _text(form, "deadline") or None
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
    command_id = request.path_params["command_id"]
    found = await ControlClient(console_of(request).connection).find_reply(site, node, command_id)
    context = {"site": site, "node": node, "id": command_id, "reply": found}
    return render(request, "_reply.html", context)


def _reports(root: Path) -> list[dict[str, Any]]:
    """The newest audit reports under ``root`` (``audit.json`` beside its ``audit.html``)."""
    if not root.is_dir():
        return []
    found = sorted(root.glob("**/audit.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    reports = []
    for index, path in enumerate(found[:MAX_REPORTS]):
        try:
            findings = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            findings = {}
        reports.append(
            {
                "index": index,
                "path": str(path.parent.relative_to(root)),
                "ok": bool(findings.get("ok")) if isinstance(findings, dict) else False,
                "generated": findings.get("generated_at", "") if isinstance(findings, dict) else "",
                "html": (path.parent / "audit.html").is_file(),
            }
        )
    return reports


@page
async def pipeline(request: Request) -> Response:
    root = console_of(request).reports
    return render(request, "pipeline.html", {"reports": _reports(root), "root": str(root)})


@page
async def report(request: Request) -> Response:
    root = console_of(request).reports
    index = int(request.path_params["index"])
    found = sorted(root.glob("**/audit.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    if index >= len(found) or not (found[index].parent / "audit.html").is_file():
        return PlainTextResponse("no such report", status_code=404)
    response = FileResponse(found[index].parent / "audit.html", media_type="text/html")
    response.headers["Content-Security-Policy"] = REPORT_CSP
    return response


async def login(request: Request) -> Response:
    console = console_of(request)
    target = request.query_params.get("next", "/")
    if not target.startswith("/") or target.startswith("//"):
        target = "/"  # only paths of this console: no open redirect
    if not console.tokens.configured:
        return see_other(target)  # no token to give: the local user is already in
    if request.method == "GET":
        return render(request, "login.html", {"next": target, "error": ""})
    form = await request.form()
    token, name = _text(form, "token"), _text(form, "name")[:64]
    role = console.tokens.role_of(token) if token else None
    if role is None:
        audit(User("viewer", "session", name or "?", client_of(request)), "failed sign-in")
        return render(request, "login.html", {"next": target, "error": "wrong token"}, 401)
    request.session.clear()
    request.session.update({"role": role, "name": name or role})
    audit(User(role, "session", name or role, client_of(request)), "signed in")
    return see_other(target)


async def logout(request: Request) -> Response:
    request.session.clear()
    return see_other("/login")


routes = [
    Route("/healthz", healthz),
    Route("/", overview),
    Route("/nodes", nodes),
    Route("/nodes/send", send, methods=["POST"]),
    Route("/nodes/{site}/{node}/replies/{command_id}", reply),
    Route("/pipeline", pipeline),
    Route("/pipeline/{index:int}", report),
    Route("/login", login, methods=["GET", "POST"]),
    Route("/logout", logout, methods=["POST"]),
]
