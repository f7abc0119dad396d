"""Connect to NATS: retries with backoff at start, reconnect forever after, auth, TLS, health.

Example::

    async with await connect(load_settings(), url="nats://127.0.0.1:4222") as conn:
        await conn.js.publish("evt.default.demo.order.created", b"{}")
        print(await conn.health())   # {"state": "connected", "server": ..., "jetstream": {...}}
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import ssl
from types import TracebackType
from typing import Any, Literal, Self
from urllib.parse import urlsplit, urlunsplit

from nats.aio.client import Client as NATS
from nats.errors import AuthorizationError, NoServersError
from nats.js import JetStreamContext

from meshforge.config import Settings, load_settings
from meshforge.errors import ConfigError, ConnectionFailed, one_line
from meshforge.headers import install as _install_header_parser

__all__ = ["DEFAULT_URL", "Connection", "connect", "redact_url", "tls_context"]

log = logging.getLogger("meshforge.connection")
_install_header_parser()  # every received message is parsed by it

DEFAULT_URL = "nats://127.0.0.1:4222"
State = Literal["connecting", "connected", "reconnecting", "closed"]

# First-connect backoff: base doubles per attempt up to the cap, then full jitter.
_BACKOFF_BASE = 0.2
_BACKOFF_CAP = 5.0
_RECONNECT_WAIT = 1.0
_FIRST_TRY_WAIT = 0.05
_HEALTH_TIMEOUT = 2.0


def redact_url(url: str) -> str:
    """The URL without user name, password or token, fit for logs.

    >>> redact_url("nats://alice:secret@host:4222")
    'nats://***@host:4222'
    """
    parts = []
    for one in url.split(","):
        split = urlsplit(one.strip())
        if split.username is not None or split.password is not None:
            host = split.hostname or ""
            netloc = f"***@{host}" + (f":{split.port}" if split.port else "")
            one = urlunsplit(split._replace(netloc=netloc))
        parts.append(one.strip())
    return ",".join(parts)


def ssl_context(
    ca: str | None, cert: str | None, key: str | None, *, label: str = "tls"
) -> ssl.SSLContext | None:
    """A client SSL context trusting ``ca`` and presenting ``cert`` + ``key``; None when neither is set."""
    if not (ca or cert):
        return None
    for name, path in (("tls_ca", ca), ("tls_cert", cert), ("tls_key", key)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{name}: expected a readable file, got {path!r}")
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        if cert:
            context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{label}: cannot load certificates: {one_line(exc, 300)}") from None
    return context


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """An SSL context from ``tls_ca`` / ``tls_cert`` + ``tls_key``, or None when none is set."""
    return ssl_context(settings.tls_ca, settings.tls_cert, settings.tls_key)


def _auth_options(settings: Settings) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if settings.user is not None:
        options["user"] = settings.user
        options["password"] = settings.password or ""
    if settings.token is not None:
        options["token"] = settings.token
    if settings.creds_file is not None:
        if not os.path.isfile(settings.creds_file):
            raise ConfigError(f"creds_file: expected a readable file, got {settings.creds_file!r}")
        options["user_credentials"] = settings.creds_file
    tls = tls_context(settings)
    if tls is not None:
        options["tls"] = tls
    return options


class Connection:
    """A NATS connection with its JetStream context and a state the callbacks keep.

    ``state`` is ``connected``, ``reconnecting`` (lost; nats-py retries forever) or
    ``closed``. Use ``connect()`` to build one.
    """

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self.nc = NATS()
        self.state: State = "connecting"
        self.reconnects = 0
        self.last_error: str | None = None
        self._js: JetStreamContext | None = None

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context (created once per connection)."""
        if self._js is None:
            self._js = self.nc.jetstream()
        return self._js

    # Callbacks: nats-py calls them from its own tasks; they only log and track state.
    async def _on_disconnected(self) -> None:
        if self.state != "closed" and not self.nc.is_closed:
            self.state = "reconnecting"
            log.warning("disconnected from NATS %s; reconnecting", redact_url(self.url))

    async def _on_reconnected(self) -> None:
        self.state = "connected"
        self.reconnects += 1
        log.info("reconnected to NATS %s", self._server())

    async def _on_error(self, exc: Exception) -> None:
        self.last_error = one_line(exc, 300)
        # While connecting, connect() reports the failure itself; keep the log quiet.
        level = logging.DEBUG if self.state == "connecting" else logging.WARNING
        log.log(level, "NATS error on %s: %s", redact_url(self.url), self.last_error)

    async def _on_closed(self) -> None:
        if self.state != "connecting":
            log.info("NATS connection %s closed", redact_url(self.url))
        self.state = "closed"

    def _server(self) -> str:
        current = self.nc.connected_url
        return redact_url(current.geturl()) if current is not None else redact_url(self.url)

    def current_state(self) -> State:
        """The state as the client sees it now (the callbacks may lag by a moment)."""
        if self.nc.is_closed:
            return "closed"
        if self.nc.is_connected:
            return "connected"
        if self.nc.is_reconnecting or self.state == "reconnecting":
            return "reconnecting"
        return self.state

    async def health(self) -> dict[str, Any]:
        """Connection state, server URL and JetStream account usage (or the error).

        Example result::

            {"state": "connected", "server": "nats://127.0.0.1:4222", "reconnects": 0,
             "jetstream": {"streams": 5, "consumers": 2, "memory": 0, "storage": 1024}}
        """
        state = self.current_state()
        report: dict[str, Any] = {
            "state": state,
            "server": self._server(),
            "name": self.name,
            "reconnects": self.reconnects,
            "last_error": self.last_error,
        }
        if state != "connected":
            report["jetstream"] = {"error": f"not connected ({state})"}
            return report
        try:
            info = await self.nc.jsm(timeout=_HEALTH_TIMEOUT).account_info()
        except Exception as exc:  # any failure is the health answer, never a crash
            report["jetstream"] = {"error": one_line(exc, 300)}
        else:
            report["jetstream"] = {
                "streams": info.streams,
                "consumers": info.consumers,
                "memory": info.memory,
                "storage": info.storage,
            }
        return report

    async def close(self) -> None:
        """Drain (finish in-flight subscriptions and flush publishes), then close."""
        if self.nc.is_closed:
            self.state = "closed"
            return
        try:
            if self.nc.is_connected:
                await self.nc.drain()
            else:
                await self.nc.close()
        except Exception as exc:  # closing must not fail the caller's shutdown
            log.warning("closing NATS connection: %s", one_line(exc, 300))
            await self.nc.close()
        self.state = "closed"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _attempt(self, settings: Settings, options: dict[str, Any]) -> None:
        await self.nc.connect(
            servers=[u.strip() for u in self.url.split(",")],
            name=self.name,
            connect_timeout=settings.connect_timeout,  # type: ignore[arg-type]  # float works
            # Few quick tries per attempt: our loop owns first-connect retries and backoff.
            allow_reconnect=False,
            max_reconnect_attempts=1,
            reconnect_time_wait=_FIRST_TRY_WAIT,  # type: ignore[arg-type]  # float works
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            closed_cb=self._on_closed,
            **options,
        )
        # Once connected, reconnect forever: nats-py reads these options at disconnect time.
        self.nc.options["allow_reconnect"] = True
        self.nc.options["max_reconnect_attempts"] = -1
        self.nc.options["reconnect_time_wait"] = _RECONNECT_WAIT
        self.state = "connected"


def _delay(attempt: int) -> float:
    return random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2**attempt))  # full jitter


async def connect(
    settings: Settings | None = None, *, url: str | None = None, name: str = "meshforge"
) -> Connection:
    """Connect with ``settings.connect_attempts`` tries (exponential backoff with jitter).

    The URL is ``url``, else ``settings.nats_url``, else ``nats://127.0.0.1:4222``; several
    servers may be given separated by commas. Once connected, the client reconnects
    forever. Raises ``ConnectionFailed`` naming the URL and the last error; a refused
    login fails at once (retrying cannot help).

    Example::

        conn = await connect(url="nats://127.0.0.1:4222")
        await conn.close()
    """
    settings = settings if settings is not None else load_settings()
    target = url or settings.nats_url or DEFAULT_URL
    options = _auth_options(settings)
    last: str = "no attempt was made"
    attempts = 0
    for attempt in range(settings.connect_attempts):
        attempts += 1
        conn = Connection(target, name)
        try:
            await conn._attempt(settings, options)
        except asyncio.CancelledError:
            await _quiet_close(conn)
            raise
        except Exception as exc:  # nats-py raises many kinds; each is one failed attempt
            # "no servers available" hides the socket error the error callback saw
            last = (
                conn.last_error
                if isinstance(exc, NoServersError) and conn.last_error
                else one_line(exc, 300)
            )
            await _quiet_close(conn)
            if isinstance(exc, AuthorizationError) or "authorization" in last.lower():
                break
            if attempt + 1 < settings.connect_attempts:
                delay = _delay(attempt)
                log.info(
                    "connect to %s failed (%s); attempt %d/%d, next in %.2fs",
                    redact_url(target),
                    last,
                    attempt + 1,
                    settings.connect_attempts,
                    delay,
                )
                await asyncio.sleep(delay)  # backoff between connection attempts
            continue
        log.info("connected to NATS %s", conn._server())
        return conn
    raise ConnectionFailed(
        f"cannot connect to NATS at {redact_url(target)} after {attempts} attempt(s): {last}"
    )


async def _quiet_close(conn: Connection) -> None:
    try:
        await conn.nc.close()
    except Exception:  # the attempt already failed; its cleanup must not mask why
        log.debug("cleanup after failed connect", exc_info=True)
