"""Who may use the console: roles from tokens, sessions for people, CSRF and security headers.

Two roles: ``viewer`` reads, ``operator`` also acts (re-drive, purge, send). Scripts send
``Authorization: Bearer TOKEN``; people log in with the token once and get a signed,
HTTP-only session cookie. A console with no token configured serves loopback only and
treats its (local) user as operator, like the ``meshforge`` command on the same machine.

Example::

    tokens = ConsoleTokens.from_settings(settings)
    tokens.role_of("s3cret")     # "operator", "viewer" or None
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from starlette.requests import Request

from meshforge.config import Settings
from meshforge.errors import ConfigError

__all__ = [
    "CSRF_FIELD",
    "ConsoleTokens",
    "Role",
    "User",
    "check_bind",
    "is_loopback",
]

log = logging.getLogger("meshforge.console.audit")

Role = Literal["viewer", "operator"]
CSRF_FIELD = "csrf"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})


def _token(value: str | None, path: str | None, label: str) -> str | None:
    """A token from its setting, else from its ``_file`` setting (trailing newline dropped)."""
    if value:
        return value
    if not path:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"{label}_file: cannot read {path!r}: {exc.strerror}") from None
    if not text:
        raise ConfigError(f"{label}_file: {path!r} is empty")
    return text


@dataclass(frozen=True, slots=True)
class ConsoleTokens:
    """The configured tokens; never printed (``repr`` leaves them out)."""

    viewer: str | None = field(default=None, repr=False)
    operator: str | None = field(default=None, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> ConsoleTokens:
        viewer = _token(
            settings.console_viewer_token,
            settings.console_viewer_token_file,
            "console_viewer_token",
        )
        operator = _token(
            settings.console_operator_token,
            settings.console_operator_token_file,
            "console_operator_token",
        )
        if viewer and operator and hmac.compare_digest(viewer, operator):
            raise ConfigError("console_viewer_token: must differ from console_operator_token")
        return cls(viewer, operator)

    @property
    def configured(self) -> bool:
        return bool(self.viewer or self.operator)

    def role_of(self, given: str) -> Role | None:
        """The role ``given`` grants; compared in constant time."""
        found: Role | None = None
        if self.operator and hmac.compare_digest(given.encode(), self.operator.encode()):
            found = "operator"
        if self.viewer and hmac.compare_digest(given.encode(), self.viewer.encode()):
            found = "viewer"
        return found


@dataclass(frozen=True, slots=True)
class User:
    """The caller of one request: role, how they proved it, and a name for the audit log."""

    role: Role
    via: Literal["bearer", "session", "loopback"]
    name: str
    client: str

    @property
    def can_act(self) -> bool:
        return self.role == "operator"

    def __str__(self) -> str:
        return f"{self.name} ({self.role} via {self.via} from {self.client})"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address) is this machine only."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, tokens: ConsoleTokens) -> None:
    """Refuse to listen beyond loopback without tokens: the console can command valves."""
    if not is_loopback(host) and not tokens.configured:
        raise ConfigError(
            f"console: refusing to listen on {host!r} without authentication; set "
            "MESHFORGE_CONSOLE_OPERATOR_TOKEN (and/or _VIEWER_TOKEN), or use --host 127.0.0.1"
        )


def client_of(request: Request) -> str:
    return request.client.host if request.client else "?"


def current_user(request: Request, tokens: ConsoleTokens) -> User | None:
    """The authenticated caller of ``request``, or None."""
    client = client_of(request)
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        role = tokens.role_of(header[7:].strip())
        return User(role, "bearer", "script", client) if role else None
    if not tokens.configured:
        return User("operator", "loopback", "local user", client)
    role = request.session.get("role")
    if role in ("viewer", "operator"):
        return User(role, "session", str(request.session.get("name") or "anonymous"), client)
    return None


def csrf_token(request: Request) -> str:
    """This session's CSRF token (made on first use); every form posts it back."""
    token = request.session.get(CSRF_FIELD)
    if not isinstance(token, str):
        token = secrets.token_urlsafe(32)
        request.session[CSRF_FIELD] = token
    return token


def csrf_ok(request: Request, user: User, posted: str | None) -> bool:
    """A bearer caller sends no ambient credential; everyone else must post the token back."""
    if user.via == "bearer":
        return True
    expected = request.session.get(CSRF_FIELD)
    return (
        isinstance(expected, str)
        and isinstance(posted, str)
        and hmac.compare_digest(expected.encode(), posted.encode())
    )


def audit(user: User, action: str) -> None:
    """Every action leaves one line naming who did it."""
    log.info("console action by %s: %s", user, action)


# Pages run only scripts and styles served from the console itself, in no frame.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'; "
    "object-src 'none'"
)
# An audit report is self-contained HTML with inline styles and SVG, and no script.
REPORT_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'none'; "
    "base-uri 'none'; form-action 'none'"
)
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-store",
}
