"""A small ASGI client for the console's tests: requests straight into the app, with cookies.

It sets the client address of each request (the sign-in throttle keys on it) and keeps
whatever answer the app sent, even when the app raised afterwards.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

from starlette.applications import Starlette

HOST = "127.0.0.1:8222"
COOKIE = "meshforge_console"
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    raised: BaseException | None = None

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name.lower():
                return value
        return None

    def all(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key == name.lower()]

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def csrf(self) -> str:
        found = _CSRF.search(self.text)
        assert found, f"no CSRF field in the page:\n{self.text[:500]}"
        return found.group(1)


@dataclass
class Browser:
    """One client: an address and a cookie jar (one cookie, the console's session)."""

    app: Starlette
    client: tuple[str, int] = ("10.0.0.7", 40000)
    cookies: dict[str, str] = field(default_factory=dict)
    scheme: str = "http"

    async def get(self, path: str, query: Mapping[str, str] | str = "", **headers: str) -> Answer:
        return await self.request("GET", path, query=query, headers=headers)

    async def post(
        self,
        path: str,
        form: Mapping[str, str] | list[tuple[str, str]] | None = None,
        query: Mapping[str, str] | str = "",
        **headers: str,
    ) -> Answer:
        body = urlencode(list(form.items()) if isinstance(form, Mapping) else form or []).encode()
        headers = {"content-type": "application/x-www-form-urlencoded", **headers}
        return await self.request("POST", path, query=query, headers=headers, body=body)

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | str = "",
        headers: Mapping[str, str] | None = None,
        body: bytes = b"",
    ) -> Answer:
        query_string = query if isinstance(query, str) else urlencode(list(query.items()))
        sent = {
            "host": HOST,
            **{k.replace("_", "-").lower(): v for k, v in (headers or {}).items()},
        }
        if self.cookies:
            sent["cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        sent["content-length"] = str(len(body))
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},  # no disconnect watch
            "http_version": "1.1",
            "method": method,
            "scheme": self.scheme,
            "path": path,
            "raw_path": quote(path, safe="/").encode(),
            "root_path": "",
            "query_string": query_string.encode(),
            "headers": [(k.encode(), v.encode("utf-8")) for k, v in sent.items()],
            "client": self.client,
            "server": ("127.0.0.1", 8222),
            "state": {},
        }
        chunks = [{"type": "http.request", "body": body, "more_body": False}]
        started: dict[str, Any] = {}
        parts: list[bytes] = []

        async def receive() -> dict[str, Any]:
            return chunks.pop(0) if chunks else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.update(message)
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))

        raised: BaseException | None = None
        try:
            await self.app(scope, receive, send)
        except Exception as exc:  # the answer the app sent before raising is what counts
            raised = exc
        assert started, f"{method} {path}: no answer at all ({raised!r})"
        headers_out = [(k.decode().lower(), v.decode("latin-1")) for k, v in started["headers"]]
        answer = Answer(int(started["status"]), headers_out, b"".join(parts), raised)
        for cookie in answer.all("set-cookie"):
            name, _, rest = cookie.partition("=")
            value = rest.split(";", 1)[0]
            if value in ("", "null") or "expires=thu, 01 jan 1970" in cookie.lower():
                self.cookies.pop(name, None)
            else:
                self.cookies[name] = value
        return answer

    async def sign_in(self, token: str, name: str = "alice", **headers: str) -> Answer:
        """Through the form, as a person does: the form's CSRF token posted back."""
        form = await self.get("/login")
        assert form.status == 200, form.text
        return await self.post(
            "/login", {"csrf": form.csrf(), "name": name, "token": token}, **headers
        )


@contextlib.asynccontextmanager
async def running(app: Starlette) -> AsyncIterator[Starlette]:
    """The app with its lifespan run (its NATS connection open)."""
    async with app.router.lifespan_context(app):
        yield app
