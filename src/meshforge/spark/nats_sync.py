"""A small synchronous NATS client for Spark tasks and the planner.

Spark calls data-source methods synchronously, on executors as well as on the driver.
Each call that needs NATS opens its own short-lived nats-py connection inside its own
asyncio loop: nothing NATS-related is ever pickled or shared between tasks.

Example::

    conn = ConnOptions.from_options({"servers": "nats://127.0.0.1:4222"})
    with SyncNats(conn) as client:
        info = client.stream_info("MESHFORGE_EVENTS")
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field, fields
from types import TracebackType
from typing import Any, Self, TypeVar

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from meshforge.config import parse_duration
from meshforge.errors import (
    ConfigError,
    ConnectionFailed,
    InvalidSubject,
    MissingTopology,
    one_line,
)
from meshforge.topology.subjects import validate_subject
from meshforge.transport.credentials import NatsAuth, nats_auth_options, redact_url
from meshforge.transport.retry import attempt_connect, check_inbox, close_bounded, retry_connect

__all__ = ["ConnOptions", "JetStreamApiError", "StreamInfo", "SyncNats", "lower_keys"]

T = TypeVar("T")

_NOT_FOUND = 10059  # JetStream's "stream not found" error code


class JetStreamApiError(ConnectionFailed):
    """A JetStream API call answered with an error."""

    def __init__(self, message: str, *, code: int = 0, err_code: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.err_code = err_code


def lower_keys(options: Mapping[str, str]) -> dict[str, str]:
    """Spark's options are case-insensitive: look them up by their lower-case names."""
    return {str(k).lower(): v for k, v in options.items()}


def _number(options: Mapping[str, str], name: str, default: str, cast: type[float] | type[int]) -> Any:
    """A positive option value; durations such as ``"2s"`` too, as the settings take them."""
    raw = options.get(name) or os.environ.get(f"MESHFORGE_{name.upper()}") or default
    try:
        value = parse_duration(raw) if cast is float else int(raw)
    except (ConfigError, ValueError):
        value = 0
    if value <= 0:
        kind = "a duration > 0 such as 5 or '2s'" if cast is float else "an integer >= 1"
        raise ConfigError(f"jetstream: option '{name}' must be {kind}, got {raw!r}")
    return value


def _inbox_prefix(raw: str | None) -> str | None:
    """The ``inbox_prefix`` option checked as the setting is: a subject without wildcards."""
    if raw is None:
        return None
    try:
        return validate_subject(str(raw).strip())
    except InvalidSubject:
        raise ConfigError(
            f"jetstream: option 'inbox_prefix' must be a subject without wildcards such as _INBOX_acme, got {raw!r}"
        ) from None


@dataclass(frozen=True, slots=True)
class ConnOptions:
    """How to reach NATS: the data source's connection options, picklable; secrets kept out of repr."""

    servers: tuple[str, ...]
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds: str | None = None
    nkey_seed: str | None = field(default=None, repr=False)
    nkey_seed_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    inbox_prefix: str | None = None  # None: from the user, as the runtime does
    connect_timeout: float = 5.0
    connect_attempts: int = 3

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> ConnOptions:
        """Read ``servers`` (comma separated), auth, TLS and retry options; env as fallback."""
        options = lower_keys(options)
        raw = options.get("servers") or os.environ.get("MESHFORGE_NATS_URL")
        if not raw:
            raise ConfigError("jetstream: option 'servers' is required (e.g. nats://127.0.0.1:4222)")
        servers = tuple(s.strip() for s in str(raw).split(",") if s.strip())
        conn = cls(
            servers=servers,
            user=options.get("user"),
            password=options.get("password"),
            token=options.get("token"),
            creds=options.get("creds"),
            nkey_seed=options.get("nkey_seed"),
            nkey_seed_file=options.get("nkey_seed_file"),
            tls_ca=options.get("tls_ca"),
            tls_cert=options.get("tls_cert"),
            tls_key=options.get("tls_key"),
            inbox_prefix=_inbox_prefix(options.get("inbox_prefix") or os.environ.get("MESHFORGE_INBOX_PREFIX")),
            connect_timeout=_number(options, "connect_timeout", "5", float),
            connect_attempts=_number(options, "connect_attempts", "3", int),
        )
        conn.auth_kwargs()  # a missing file or a bad seed fails here, on the driver
        return conn

    def __repr__(self) -> str:
        # a server URL may carry a password; secrets are left out altogether
        shown = [f"servers={self.url!r}"] + [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.repr and f.name != "servers"
        ]
        return f"ConnOptions({', '.join(shown)})"

    @property
    def url(self) -> str:
        """The servers without credentials, fit for errors."""
        return redact_url(",".join(self.servers))

    @property
    def secrets(self) -> tuple[str | None, ...]:
        return (self.password, self.token, self.nkey_seed)

    def auth_kwargs(self) -> dict[str, Any]:
        """Auth and TLS keyword arguments for ``nats.connect``; ConfigError on a bad file or seed."""
        auth = NatsAuth(
            user=self.user, password=self.password, token=self.token, creds_file=self.creds,
            nkey_seed=self.nkey_seed, nkey_seed_file=self.nkey_seed_file,
            tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key,
            inbox_prefix=self.inbox_prefix,
        )  # fmt: skip
        try:
            return nats_auth_options(auth, label="jetstream")
        except ConfigError as exc:
            message = str(exc)
            raise ConfigError(message if message.startswith("jetstream") else f"jetstream: {message}") from None


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """What the reader needs to know about a stream."""

    name: str
    first_seq: int
    last_seq: int
    messages: int
    bytes: int
    retention: str
    allow_direct: bool
    first_ts: str | None

    @property
    def next_seq(self) -> int:
        """The sequence the next stored message will get."""
        return self.last_seq + 1

    @property
    def avg_size(self) -> int:
        return self.bytes // self.messages if self.messages else 0


class SyncNats:
    """One NATS connection driven by a private event loop; use as a context manager."""

    def __init__(self, conn: ConnOptions) -> None:
        self.conn = conn
        self._loop = asyncio.new_event_loop()
        self._nc: NATS | None = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        try:
            self._nc = self.run(self._connect())
        except BaseException:
            self._loop.close()
            if self._thread is not None:
                self._thread.shutdown()
            raise

    async def _connect(self) -> NATS:
        conn = self.conn
        options = conn.auth_kwargs()

        async def once() -> NATS:
            nc = NATS()
            # no reconnect loop: a broken call fails and the caller reconnects (see reconnect)
            await attempt_connect(
                nc, list(conn.servers), connect_timeout=conn.connect_timeout,
                secrets=conn.secrets, name="meshforge-spark", **options,
            )  # fmt: skip
            await check_inbox(nc, conn.connect_timeout)
            return nc

        return await retry_connect(
            ",".join(conn.servers), conn.connect_attempts, once, secrets=conn.secrets
        )

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise ConnectionFailed("the NATS connection is closed")
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    def reconnect(self) -> None:
        """Drop a broken connection and open a new one."""
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            self.run(close_bounded(nc))
        self._nc = self.run(self._connect())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` to completion on this client's loop.

        Called from inside a running event loop (a notebook, an async caller), the
        private loop is driven from a helper thread instead, as one loop per thread needs.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._loop.run_until_complete(coro)
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshforge-nats")
        return self._thread.submit(self._loop.run_until_complete, coro).result()

    async def api(self, subject: str, payload: Mapping[str, Any] | None = None, wait: float = 5.0) -> dict[str, Any]:
        """A JetStream API request; raises JetStreamApiError on an error answer."""
        body = json.dumps(payload).encode() if payload is not None else b""
        try:
            msg = await self.nc.request(subject, body, timeout=wait)
        except Exception as exc:
            # A forbidden request is not answered; the server's -ERR says why.
            last = str(getattr(self.nc, "last_error", None) or "").lower()  # the client lower-cases it
            if "permissions violation" in last and f'"{subject.lower()}"' in last:
                raise ConnectionFailed(
                    f"JetStream API {subject}: permissions violation for publish to {subject!r};"
                    " the Spark role needs it (see `meshforge permissions spark`)"
                ) from None
            raise ConnectionFailed(f"JetStream API {subject}: {one_line(exc, 300)}") from None
        try:
            answer: dict[str, Any] = json.loads(msg.data or b"{}")
        except ValueError:
            raise JetStreamApiError(f"JetStream API {subject}: answer is not JSON") from None
        err = answer.get("error")
        if err:
            raise JetStreamApiError(
                f"JetStream API {subject}: {err.get('description', 'error')}",
                code=int(err.get("code", 0)),
                err_code=int(err.get("err_code", 0)),
            )
        return answer

    async def stream_info_async(self, stream: str) -> StreamInfo:
        try:
            answer = await self.api(f"$JS.API.STREAM.INFO.{stream}")
        except JetStreamApiError as exc:
            if exc.err_code == _NOT_FOUND or exc.code == 404:
                raise MissingTopology(
                    f"stream {stream!r} not found on {self.conn.url}"
                ) from None
            raise
        config, state = answer.get("config", {}), answer.get("state", {})
        return StreamInfo(
            name=stream,
            first_seq=int(state.get("first_seq", 0)),
            last_seq=int(state.get("last_seq", 0)),
            messages=int(state.get("messages", 0)),
            bytes=int(state.get("bytes", 0)),
            retention=str(config.get("retention", "limits")),
            allow_direct=bool(config.get("allow_direct", False)),
            first_ts=state.get("first_ts"),
        )

    def stream_info(self, stream: str) -> StreamInfo:
        """The stream's state (first/last sequence, retention); MissingTopology if absent."""
        return self.run(self.stream_info_async(stream))

    def seq_at_time(self, stream: str, when_rfc3339: str) -> int:
        """The first sequence stored at or after a time (the next sequence if none)."""

        async def lookup() -> int:
            try:
                answer = await self.api(
                    f"$JS.API.STREAM.MSG.GET.{stream}", {"start_time": when_rfc3339}
                )
            except JetStreamApiError as exc:
                if exc.code == 404:
                    return (await self.stream_info_async(stream)).next_seq
                raise
            return int(answer["message"]["seq"])

        return self.run(lookup())

    def close(self) -> None:
        nc, self._nc = self._nc, None
        try:
            if nc is not None and not nc.is_closed:
                self.run(close_bounded(nc))
        finally:
            self._loop.close()
            if self._thread is not None:
                self._thread.shutdown()
                self._thread = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
