"""The first connection to NATS: bounded attempts, a progress line per retry, bounded close.

Every attempt and every close has a deadline, so a wrong password, an untrusted CA or a
refused port ends in one ``ConnectionFailed`` line within about
``connect_timeout x connect_attempts`` (plus the backoff), never a hang. Used by the
runtime's ``connect()`` and by the Spark client alike.

Example::

    async def once() -> NATS:
        nc = NATS()
        await attempt_connect(nc, ["nats://127.0.0.1:4222"], connect_timeout=2.0)
        return nc

    nc = await retry_connect("nats://127.0.0.1:4222", 3, once)
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.errors import AuthorizationError, NoServersError

from meshforge.errors import ConnectionFailed, one_line
from meshforge.transport.credentials import hide_secrets, redact_url, url_user, user_inbox_prefix

__all__ = ["AttemptFailed", "attempt_connect", "check_inbox", "close_bounded", "retry_connect"]

T = TypeVar("T")
log = logging.getLogger("meshforge.connection")

# First-connect backoff: base doubles per attempt up to the cap, then full jitter.
_BACKOFF_BASE = 0.2
_BACKOFF_CAP = 5.0
_FIRST_TRY_WAIT = 0.05
# nats-py's close() can wait for ever on a transport whose TLS handshake failed
CLOSE_TIMEOUT = 2.0
_FAILED_CLOSE_TIMEOUT = 0.5  # a failed attempt has nothing to flush

_HINTS = (
    ("authorization", "check the user/password, token, NKey seed or credentials file"),
    (
        "certificate_verify_failed",
        "set tls_ca or MESHFORGE_TLS_CA to the CA of the server certificate",
    ),
    ("certificate_required", "the server wants a client certificate: set tls_cert and tls_key"),
    ("certificate required", "the server wants a client certificate: set tls_cert and tls_key"),
    (
        "after the tls handshake",
        "does the server require a client certificate? set tls_cert and tls_key",
    ),
    ("wrong_version_number", "the server does not speak TLS here: use nats:// or check the port"),
)


class AttemptFailed(Exception):
    """One connection attempt failed; ``final`` when trying again cannot help."""

    def __init__(self, reason: str, *, final: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.final = final


def _is_final(exc: BaseException, reason: str) -> bool:
    # a refused login or a certificate problem is configuration: retrying cannot help
    low = reason.lower()
    return (
        isinstance(exc, AuthorizationError | ssl.SSLError)
        or "authorization" in low
        or "certificate" in low
        or "ssl" in low
    )


def _hint(reason: str) -> str:
    low = reason.lower()
    for needle, hint in _HINTS:
        if needle in low:
            return f" (hint: {hint})"
    return ""


async def close_bounded(nc: NATS, timeout: float = CLOSE_TIMEOUT) -> None:  # noqa: ASYNC109
    """Close ``nc``, giving up after ``timeout`` seconds; never raises."""
    try:
        await asyncio.wait_for(nc.close(), timeout)
    except TimeoutError:
        log.debug("NATS close did not finish within %.1fs; abandoned", timeout)
    except Exception:  # the connection already failed; its cleanup must not mask why
        log.debug("closing a failed NATS connection", exc_info=True)


async def attempt_connect(
    nc: NATS,
    servers: list[str],
    *,
    connect_timeout: float,
    error_cb: Callable[[Exception], Awaitable[None]] | None = None,
    secrets: tuple[str | None, ...] = (),
    **options: Any,
) -> None:
    """One bounded ``nc.connect`` (no reconnect loop); on failure close ``nc`` and raise AttemptFailed."""
    seen: list[str] = []
    if "inbox_prefix" not in options:  # no user setting: the URL's user, else nats-py's own
        options["inbox_prefix"] = user_inbox_prefix(url_user(servers))

    async def on_error(exc: Exception) -> None:
        seen.append(one_line(exc, 300))
        if error_cb is not None:
            await error_cb(exc)

    # TCP connect and the INFO/TLS exchange each get connect_timeout from nats-py
    bound = 2 * connect_timeout + 1.0
    try:
        await asyncio.wait_for(
            nc.connect(
                servers=servers,
                connect_timeout=connect_timeout,  # type: ignore[arg-type]  # float works
                allow_reconnect=False,
                # nats-py reads 0 as "retry for ever": one try per server per attempt
                max_reconnect_attempts=1,
                reconnect_time_wait=_FIRST_TRY_WAIT,  # type: ignore[arg-type]  # float works
                error_cb=on_error,
                **options,
            ),
            bound,
        )
    except asyncio.CancelledError:
        await close_bounded(nc, _FAILED_CLOSE_TIMEOUT)
        raise
    except Exception as exc:  # nats-py raises many kinds; each is one failed attempt
        # "no servers available" hides the socket error the callback saw
        reason = seen[-1] if isinstance(exc, NoServersError) and seen else one_line(exc, 300)
        if isinstance(exc, TimeoutError) and not str(exc).strip(" :nats"):
            reason = f"no answer within {bound:g}s"
        if (
            "tls" in options
            and isinstance(exc, ConnectionError | NoServersError)  # reset, broken pipe, aborted
            and any(word in reason.lower() for word in ("lost", "broken pipe", "reset"))
        ):
            # TLS 1.3 servers refuse a missing client certificate after the handshake
            reason += " after the TLS handshake"
        reason = hide_secrets(reason, secrets)
        await close_bounded(nc, _FAILED_CLOSE_TIMEOUT)
        raise AttemptFailed(reason, final=_is_final(exc, reason)) from None


async def check_inbox(nc: NATS, timeout: float) -> None:  # noqa: ASYNC109
    """Subscribe once under the reply-inbox prefix; AttemptFailed (final) when the server
    refuses it: a user not allowed to (say, granted only ``_INBOX.>``) would otherwise see
    every request and publish time out."""
    try:
        sub = await nc.subscribe(nc.new_inbox())
        # nats-py writes a PING at once but the SUB from its flusher task, so the first
        # PING may overtake the SUB; the second follows it, and the -ERR precedes its PONG.
        await nc.flush(timeout)  # type: ignore[arg-type]  # float works
        await nc.flush(timeout)  # type: ignore[arg-type]
        await sub.unsubscribe()
    except Exception as exc:  # no answer in time: the first request will say so
        log.debug("reply inbox check: %s", one_line(exc, 300))
    denied = str(nc.last_error or "")
    if "permissions violation for subscription" not in denied.lower():
        return
    prefix = nc._inbox_prefix.decode()
    await close_bounded(nc, _FAILED_CLOSE_TIMEOUT)
    raise AttemptFailed(
        f"the user may not subscribe to its reply inbox {prefix}.> ({denied.removeprefix('nats: ')});"
        f" allow {prefix}.> (`meshforge permissions` prints it) or set MESHFORGE_INBOX_PREFIX",
        final=True,
    )


def _delay(attempt: int) -> float:
    return random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2**attempt))  # full jitter


async def retry_connect(
    target: str,
    attempts: int,
    once: Callable[[], Awaitable[T]],
    *,
    secrets: tuple[str | None, ...] = (),
) -> T:
    """Call ``once`` up to ``attempts`` times with backoff; log one warning line per retry.

    ``once`` raises AttemptFailed on a failed attempt. Raises ConnectionFailed naming the
    URL (without credentials), the attempts made and the last reason.
    """
    shown = redact_url(target)
    last = "no attempt was made"
    made = 0
    for attempt in range(attempts):
        made += 1
        try:
            return await once()
        except AttemptFailed as failed:
            last = hide_secrets(failed.reason, secrets)
            if failed.final:
                break
        if attempt + 1 < attempts:
            delay = _delay(attempt)
            log.warning(
                "NATS at %s not reachable (%s); retrying in %.1fs (attempt %d of %d)",
                shown, last, delay, attempt + 1, attempts,
            )  # fmt: skip
            await asyncio.sleep(delay)  # backoff between connection attempts
    raise ConnectionFailed(
        f"cannot connect to NATS at {shown} after {made} attempt(s): {last}{_hint(last)}"
    )
