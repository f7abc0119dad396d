"""Who may use the console: roles from tokens, sessions for people, CSRF and security headers.

Two roles: ``viewer`` reads, ``operator`` also acts (re-drive, purge, send). Scripts send
``Authorization: Bearer TOKEN``; people log in with the token once and get a signed,
HTTP-only session cookie naming a session this process keeps (``Sessions``): signing out
ends it on the server, and it ends after ``console_session_idle`` without a request, after
12 hours in all, or with the process. Sign-in is slowed per client address and capped for
everyone (``SignInThrottle``). A console with no token configured serves loopback only and
treats its (local) user as operator, like the ``meshforge`` command on the same machine.

Example::

    tokens = ConsoleTokens.from_settings(settings)
    tokens.role_of("s3cret")     # "operator", "viewer" or None
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from starlette.requests import Request

from meshforge.config import Settings
from meshforge.errors import ConfigError

__all__ = [
    "CSRF_FIELD",
    "ConsoleTokens",
    "Role",
    "Sessions",
    "SignInThrottle",
    "User",
    "check_bind",
    "is_loopback",
]

log = logging.getLogger("meshforge.console.audit")

Role = Literal["viewer", "operator"]
CSRF_FIELD = "csrf"
SESSION_FIELD = "sid"
SESSION_LIFETIME = 12 * 3600.0  # the absolute end of a sign-in, however busy
Clock = Callable[[], float]
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


@dataclass(slots=True)
class _Session:
    role: Role
    name: str
    started: float
    seen: float


class Sessions:
    """The people signed in to this process; the cookie holds only a session's random id.

    A session ends on sign-out (``end``), after ``idle`` seconds without a request, after
    ``lifetime`` seconds in all, or with the process (the table is in memory only).
    """

    def __init__(
        self,
        *,
        idle: float,
        lifetime: float = SESSION_LIFETIME,
        clock: Clock = time.monotonic,
        limit: int = 10_000,
    ) -> None:
        self.idle, self.lifetime, self.clock, self.limit = idle, lifetime, clock, limit
        self._table: dict[str, _Session] = {}

    def __len__(self) -> int:
        return len(self._table)

    def start(self, role: Role, name: str) -> str:
        """A new session's id; the oldest sessions give way once ``limit`` are open."""
        now = self.clock()
        for sid in [sid for sid, s in self._table.items() if not self._alive(s, now)]:
            del self._table[sid]
        while len(self._table) >= self.limit:
            del self._table[next(iter(self._table))]
        sid = secrets.token_urlsafe(32)
        self._table[sid] = _Session(role, name, now, now)
        return sid

    def _alive(self, session: _Session, now: float) -> bool:
        return now - session.seen < self.idle and now - session.started < self.lifetime

    def use(self, sid: object) -> _Session | None:
        """The live session ``sid`` names (its idle clock restarts), or None."""
        if not isinstance(sid, str):
            return None
        found = self._table.get(sid)
        if found is None:
            return None
        now = self.clock()
        if not self._alive(found, now):
            del self._table[sid]
            return None
        found.seen = now
        return found

    def end(self, sid: object) -> None:
        if isinstance(sid, str):
            self._table.pop(sid, None)


class SignInThrottle:
    """Slows sign-in: each wrong token from an address doubles its wait before the next try
    (``first`` seconds, up to ``longest``), and past ``global_limit`` wrong tokens within
    ``window`` seconds from anywhere, every address waits. A right token clears its address.
    """

    def __init__(
        self,
        *,
        first: float = 1.0,
        longest: float = 300.0,
        global_limit: int = 100,
        window: float = 60.0,
        clock: Clock = time.monotonic,
        addresses: int = 10_000,
    ) -> None:
        self.first, self.longest = first, longest
        self.global_limit, self.window, self.clock = global_limit, window, clock
        self.addresses = addresses
        self._failures: dict[str, tuple[int, float]] = {}  # address: (in a row, next try at)
        self._recent: collections.deque[float] = collections.deque()

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` wrong tokens in a row: 1, 2, 4, ... seconds by default."""
        if failures <= 0:
            return 0.0
        return min(self.longest, self.first * 2.0 ** min(failures - 1, 64))

    def wait(self, client: str) -> float:
        """Seconds before ``client`` may try a token (0: now)."""
        now = self.clock()
        while self._recent and now - self._recent[0] >= self.window:
            self._recent.popleft()
        everyone = (
            self._recent[0] + self.window - now if len(self._recent) >= self.global_limit else 0.0
        )
        _, next_try = self._failures.get(client, (0, now))
        return max(0.0, next_try - now, everyone)

    def failed(self, client: str) -> tuple[int, float]:
        """Counts a wrong token from ``client``: its failures in a row and its wait now."""
        now = self.clock()
        count = self._failures.pop(client, (0, now))[0] + 1
        while len(self._failures) >= self.addresses:
            del self._failures[next(iter(self._failures))]
        wait = self.delay(count)
        self._failures[client] = (count, now + wait)
        self._recent.append(now)
        return count, wait

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)


def current_user(request: Request, tokens: ConsoleTokens, sessions: Sessions) -> User | None:
    """The authenticated caller of ``request``, or None."""
    client = client_of(request)
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        role = tokens.role_of(header[7:].strip())
        return User(role, "bearer", "script", client) if role else None
    if not tokens.configured:
        return User("operator", "loopback", "local user", client)
    found = sessions.use(request.session.get(SESSION_FIELD))
    if found is None:
        return None
    return User(found.role, "session", found.name, client)


def csrf_token(request: Request) -> str:
    """This session's CSRF token (made on first use); every form posts it back."""
    token = request.session.get(CSRF_FIELD)
    if not isinstance(token, str):
        token = secrets.token_urlsafe(32)
        request.session[CSRF_FIELD] = token
    return token


def csrf_matches(request: Request, posted: object) -> bool:
    """Whether ``posted`` is the token of this browser's session cookie."""
    expected = request.session.get(CSRF_FIELD)
    return (
        isinstance(expected, str)
        and isinstance(posted, str)
        and hmac.compare_digest(expected.encode(), posted.encode())
    )


def csrf_ok(request: Request, user: User, posted: str | None) -> bool:
    """A bearer caller sends no ambient credential; everyone else must post the token back."""
    return user.via == "bearer" or csrf_matches(request, posted)


def cross_site(request: Request) -> str | None:
    """Why a POST came from another site (``Sec-Fetch-Site`` or ``Origin``), or None.

    ``Sec-Fetch-Site``, when sent, decides. Else ``Origin`` is compared by host and port
    (behind a TLS proxy the console itself sees plain HTTP); ``Origin: null`` is what our
    ``no-referrer`` policy makes a browser send for its own forms, so it, like no header at
    all, falls back on the CSRF token alone.
    """
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None:
        ok = fetch_site in ("same-origin", "none")
        return None if ok else f"Sec-Fetch-Site is {fetch_site[:20]!r}"
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return None
    host = request.headers.get("host", "").lower()
    try:
        netloc = urlsplit(origin).netloc.lower()
    except ValueError:
        netloc = ""
    if not host or netloc != host:
        return "Origin is another site"
    return None


def retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


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
