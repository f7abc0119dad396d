"""A small synchronous NATS client for Spark tasks and the planner.

Spark calls data-source methods synchronously, on executors as well as on the driver.
Each ``SyncNats`` opens its own short-lived connection (MeshForge's client class, so its
headers are read by the runtime's parser) on its own event loop thread (the
``LoopThread`` bridge ``SyncPublisher`` uses too), each call bounded, the thread joined at
``close``: nothing NATS-related is ever pickled or shared between tasks.

Example::

    conn = ConnOptions.from_options({"servers": "nats://127.0.0.1:4222"})
    with SyncNats(conn) as client:
        info = client.stream_info("MESHFORGE_EVENTS")
"""

from __future__ import annotations

import json
import os
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any, Self, TypeVar

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from meshforge.config import AuthSettings, load_auth, parse_setting
from meshforge.config.auth import AUTH_FIELDS
from meshforge.errors import ConfigError, ConnectionFailed, MissingTopology, one_line
from meshforge.transport.bridge import BridgeClosed, BridgeTimeout, LoopThread
from meshforge.transport.connection import new_client
from meshforge.transport.credentials import nats_auth_options, redact_url
from meshforge.transport.retry import attempt_connect, check_inbox, close_bounded, retry_connect

__all__ = ["ConnOptions", "JetStreamApiError", "StreamInfo", "SyncNats", "lower_keys"]

T = TypeVar("T")

_NOT_FOUND = 10059  # JetStream's "stream not found" error code
# The longest one call may take (a pull waits 30 s for a stalled server, a window of
# publishes retries for a while): past it the call is cancelled and fails, never hangs.
CALL_BOUND = 300.0
_CLOSE_BOUND = 10.0


class JetStreamApiError(ConnectionFailed):
    """A JetStream API call answered with an error."""

    def __init__(self, message: str, *, code: int = 0, err_code: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.err_code = err_code


def lower_keys(options: Mapping[str, str]) -> dict[str, str]:
    """Spark's options are case-insensitive: look them up by their lower-case names."""
    return {str(k).lower(): v for k, v in options.items()}


_PREFIX = "jetstream: "  # how the data source's errors start
#: The Spark options named otherwise than the settings they are
_OPTION_NAMES = {"creds_file": "creds"}


def _setting(options: Mapping[str, str], name: str, default: str) -> Any:
    """An option checked as the setting of that name is; its environment variable as fallback."""
    raw = options.get(name) or os.environ.get(f"MESHFORGE_{name.upper()}") or default
    return parse_setting(name, raw, _PREFIX + name)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnOptions(AuthSettings):
    """How to reach NATS: the data source's connection options, picklable; secrets kept out of repr.

    The auth and TLS fields are ``AuthSettings``' (the option of ``creds_file`` is ``creds``)."""

    servers: tuple[str, ...]
    connect_timeout: float = 5.0
    connect_attempts: int = 3

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> ConnOptions:
        """Read ``servers`` (comma separated), auth, TLS and retry options; env as fallback."""
        options = lower_keys(options)
        raw = options.get("servers") or os.environ.get("MESHFORGE_NATS_URL")
        if not raw:
            raise ConfigError(
                "jetstream: option 'servers' is required (e.g. nats://127.0.0.1:4222)"
            )
        servers = tuple(s.strip() for s in str(raw).split(",") if s.strip())
        given: dict[str, object] = {
            key: options.get(_OPTION_NAMES.get(key, key)) for key in AUTH_FIELDS
        }
        given["inbox_prefix"] = given["inbox_prefix"] or os.environ.get("MESHFORGE_INBOX_PREFIX")
        auth = load_auth(given, prefix=_PREFIX, names=_OPTION_NAMES)
        conn = cls(
            servers=servers,
            **{key: getattr(auth, key) for key in AUTH_FIELDS},
            connect_timeout=_setting(options, "connect_timeout", "5"),
            connect_attempts=_setting(options, "connect_attempts", "3"),
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

    def auth_kwargs(self) -> dict[str, Any]:
        """Auth and TLS keyword arguments for ``nats.connect``; ConfigError on a bad file or seed."""
        try:
            return nats_auth_options(self, label="jetstream")
        except ConfigError as exc:
            message = str(exc)
            raise ConfigError(
                message if message.startswith(_PREFIX) else _PREFIX + message
            ) from None


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
    """One NATS connection driven by a private event loop thread; use as a context manager."""

    def __init__(self, conn: ConnOptions) -> None:
        self.conn = conn
        self._bridge = LoopThread("meshforge-spark")
        self._nc: NATS | None = None
        try:
            self._nc = self.run(self._connect(), self._connect_bound)
        except BaseException:
            self._bridge.close(_CLOSE_BOUND)
            raise

    @property
    def _connect_bound(self) -> float:
        """How long connecting may take: each attempt (connect, the inbox check) and its backoff."""
        return self.conn.connect_attempts * (4 * self.conn.connect_timeout + 7.0) + 5.0

    async def _connect(self) -> NATS:
        conn = self.conn
        options = conn.auth_kwargs()

        async def once() -> NATS:
            nc = new_client()
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
            self.run(close_bounded(nc), _CLOSE_BOUND)
        self._nc = self.run(self._connect(), self._connect_bound)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = CALL_BOUND) -> T:
        """Run ``coro`` on this client's loop thread and wait for it, at most ``timeout`` s
        (then it is cancelled: ``ConnectionFailed``). Works inside a running loop as well."""
        try:
            return self._bridge.run(coro, timeout)
        except BridgeClosed:
            raise ConnectionFailed("the NATS connection is closed") from None
        except BridgeTimeout:
            raise ConnectionFailed(
                f"NATS at {self.conn.url}: no answer within {timeout:g}s"
            ) from None

    async def api(
        self, subject: str, payload: Mapping[str, Any] | None = None, wait: float = 5.0
    ) -> dict[str, Any]:
        """A JetStream API request; raises JetStreamApiError on an error answer."""
        body = json.dumps(payload).encode() if payload is not None else b""
        try:
            msg = await self.nc.request(subject, body, timeout=wait)
        except Exception as exc:
            # A forbidden request is not answered; the server's -ERR says why.
            last = str(
                getattr(self.nc, "last_error", None) or ""
            ).lower()  # the client lower-cases it
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
                raise MissingTopology(f"stream {stream!r} not found on {self.conn.url}") from None
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
        """Close the connection and join the loop's thread; bounded, idempotent."""
        nc, self._nc = self._nc, None

        async def last() -> None:
            if nc is not None and not nc.is_closed:
                await close_bounded(nc)

        self._bridge.close(_CLOSE_BOUND, last=last)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
