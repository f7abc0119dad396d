"""Connect to NATS: retries with backoff at start, reconnect forever after, auth, TLS, health.

Example::

    async with await connect(load_settings(), url="nats://127.0.0.1:4222") as conn:
        await conn.js.publish("evt.default.demo.order.created", b"{}")
        print(await conn.health())   # {"state": "connected", "server": ..., "jetstream": {...}}
"""

from __future__ import annotations

import logging
import re
import ssl
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Literal, Self

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.protocol.parser import (
    AWAITING_CONTROL_LINE,
    AWAITING_MSG_PAYLOAD,
    CRLF_SIZE,
    HMSG_RE,
    MSG_RE,
    Parser,
)

from meshforge.config import Settings, load_settings
from meshforge.errors import one_line
from meshforge.transport.credentials import nats_auth_options, redact_url, ssl_context
from meshforge.transport.headers import parse_header_block, parse_header_lines
from meshforge.transport.pubacks import PubAckPipe
from meshforge.transport.retry import attempt_connect, check_inbox, close_bounded, retry_connect

__all__ = [
    "DEFAULT_URL",
    "Connection",
    "close_bounded",
    "connect",
    "new_client",
    "redact_url",
    "ssl_context",
    "tls_context",
]

log = logging.getLogger("meshforge.connection")

DEFAULT_URL = "nats://127.0.0.1:4222"
State = Literal["connecting", "connected", "reconnecting", "closed"]

_RECONNECT_WAIT = 1.0
_HEALTH_TIMEOUT = 2.0


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """An SSL context from ``tls_ca`` / ``tls_cert`` + ``tls_key``, or None when none is set."""
    return ssl_context(settings.tls_ca, settings.tls_cert, settings.tls_key)


_HDR_LINE = len(b"NATS/1.0")  # a header block's first line; a space after it: a status
_HDR_START = _HDR_LINE + CRLF_SIZE
_SPACE = ord(" ")


# nats-py's own patterns, without the anchor that ties them to the start of the buffer.
_MSG = re.compile(MSG_RE.pattern.removeprefix(b"\\A"))
_HMSG = re.compile(HMSG_RE.pattern.removeprefix(b"\\A"))


class _Parser(Parser):
    """nats-py's protocol parser with a quicker path for messages, nearly all a worker
    reads: each read is parsed in place (one match and one copy per message) and handed
    to the client's synchronous ``_Client._deliver_now`` where nats-py awaits a coroutine
    per message. Every other protocol line goes through nats-py's own parser, one line at
    a time; a part of a message or line waits in ``buf`` for the next read."""

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        if buf:
            buf.extend(data)
            data = bytes(buf)
            buf.clear()
        nc = self.nc
        pos, size = 0, len(data)
        while pos < size:
            if self.state == AWAITING_MSG_PAYLOAD:
                needed, hsize = self.needed, self.header_needed
                if size - pos < needed + CRLF_SIZE:
                    break
                arg = self.msg_arg
                subject, sid, reply = arg["subject"], arg["sid"], arg["reply"]
                self.state, self.header_needed = AWAITING_CONTROL_LINE, 0
            else:
                if data.startswith(b"HMSG", pos):
                    m = _HMSG.match(data, pos)
                    if m is not None:
                        subject, sid_b, _, reply, hsize_b, needed_b = m.groups()
                        hsize = int(hsize_b)
                elif data.startswith(b"MSG", pos):
                    m = _MSG.match(data, pos)
                    if m is not None:
                        subject, sid_b, _, reply, needed_b = m.groups()
                        hsize = 0
                else:
                    m = None
                if m is None:
                    end = data.find(b"\r\n", pos)
                    if end < 0:
                        break
                    taken = await self._one_line(data[pos : end + CRLF_SIZE])
                    if self.buf is not buf:
                        return  # reset meanwhile: what was read before is gone
                    if not taken:
                        break
                    pos = end + CRLF_SIZE
                    continue
                sid, needed, pos, reply = int(sid_b), int(needed_b), m.end(), reply or b""
                if size - pos < needed + CRLF_SIZE:
                    self.msg_arg.update(subject=subject, sid=sid, reply=reply)
                    self.needed, self.header_needed = needed, hsize
                    self.state = AWAITING_MSG_PAYLOAD
                    break
            if hsize > 0:
                hdr: bytes | None = data[pos : pos + hsize]
                payload = data[pos + hsize : pos + needed]
            else:
                hdr, payload = None, data[pos : pos + needed]
            pos += needed + CRLF_SIZE
            if not nc._deliver_now(sid, subject, reply, payload, hdr):
                await nc._process_msg(sid, subject, reply, payload, hdr)
                if self.buf is not buf:
                    return
        if pos < size:
            buf.extend(data[pos:])

    async def _one_line(self, line: bytes) -> bool:
        """Hand nats-py's parser one protocol line; False when it took nothing."""
        buf = self.buf
        buf.extend(line)
        await super().parse()
        if self.buf is not buf:
            return True
        if buf:  # nats-py waits for more (a line it cannot read yet): keep it
            buf.clear()
            return False
        return True


class _Client(NATS):
    """nats-py closes the client for good on any server ``-ERR`` but a stale connection or
    a permissions error. The server drops the socket after most of them (e.g. "Maximum
    Payload Violation"), and a worker wants its connection back: reconnect instead. A
    refused login, and any error while first connecting, still close as before.
    Headers are parsed by ``meshforge.transport.headers`` (nats-py's rules, a fraction of the cost).
    JetStream publishes can take the lean path of ``meshforge.transport.pubacks`` (``pubacks``), and
    a batch's acks one write (``ack_many``)."""

    _pipe: PubAckPipe | None = None
    _direct: dict[int, Callable[[Msg | None], None]] | None = None

    def __init__(self) -> None:
        super().__init__()
        self._ps = _Parser(self)

    def pubacks(self) -> PubAckPipe:
        """This connection's lean JetStream publish path (``meshforge.transport.pubacks``)."""
        if self._pipe is None:
            self._pipe = PubAckPipe(self)
        return self._pipe

    async def ack_many(self, msgs: Sequence[Msg]) -> None:
        """Ack every message in one write (what ``Msg.ack`` does for each, less the cost
        of a publish call per message). Raises what ``Msg.ack`` would, before sending any."""
        for msg in msgs:
            msg._check_reply()
        await self.send_now(b"".join(b"PUB %s 0\r\n\r\n" % msg.reply.encode() for msg in msgs))
        for msg in msgs:
            msg._ackd = True
        self.stats["out_msgs"] += len(msgs)

    async def send_now(self, commands: bytes) -> None:
        """Queue protocol ``commands`` (already encoded) and have the flusher write them, as
        nats-py's ``publish`` does for one message."""
        await self._send_command(commands)
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()

    def deliver_direct(self, sid: int, deliver: Callable[[Msg | None], None]) -> None:
        """Hand the messages of subscription ``sid`` to ``deliver`` as they are read, instead
        of through the subscription's queue and task (a hop per message)."""
        direct = self._direct if self._direct is not None else {}
        if len(direct) > 2 * len(self._subs) + 64:  # now and then, not at every subscribe
            direct = {k: v for k, v in direct.items() if k in self._subs}
        direct[sid] = deliver
        self._direct = direct

    def wake_direct(self) -> None:
        """Hand every direct subscriber ``None`` (a wake-up): after a reconnect, a pull
        request waiting on the lost connection is gone and its waiter should know now."""
        for sid, deliver in list((self._direct or {}).items()):
            if sid in self._subs:
                deliver(None)

    def _deliver_now(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> bool:
        """Hand a PubAck to the pipe, or a message without a status to its direct
        subscriber, at once; False for any other (``_process_msg`` takes it)."""
        pipe = self._pipe
        if pipe is not None and sid == pipe.sid:
            pipe.on_reply(subject, data, headers)
            return True
        deliver = self._direct.get(sid) if self._direct is not None else None
        if deliver is None or sid not in self._subs:
            return False
        if headers is None:
            hdr = None
        elif len(headers) <= _HDR_LINE or headers[_HDR_LINE] == _SPACE:
            return False  # a status (or no header line at all): nats-py's way
        else:  # what nats-py's _process_headers gives for a block without a status
            hdr = (
                parse_header_lines(headers[_HDR_START:]) or None
                if len(headers) > _HDR_START
                else None
            )
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        deliver(self._build_message(sid, subject, reply, data, hdr))
        return True

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        # What _deliver_now left: a status for a direct subscriber, or any other message.
        deliver = self._direct.get(sid) if self._direct is not None else None
        if deliver is None or sid not in self._subs:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        msg = self._build_message(sid, subject, reply, data, await self._process_headers(headers))
        deliver(msg)

    async def _process_headers(self, headers: bytes | None) -> dict[str, str] | None:
        return parse_header_block(headers)  # MeshForge's one header parser (nats-py's rules)

    async def _process_err(self, err_msg: str) -> None:
        text = err_msg.strip().strip("'")
        lowered = text.lower()
        if (
            self.is_connecting
            or not self.options.get("allow_reconnect")
            or "authorization violation" in lowered
            or "permissions violation" in lowered
            or "stale connection" in lowered
        ):
            await super()._process_err(err_msg)
            return
        err = nats.errors.Error(f"nats: {text}")
        if self._error_cb is not None:
            await self._error_cb(err)
        await self._process_op_err(err)


def new_client() -> NATS:
    """A client of MeshForge's class (its parser, its header rules, its way with ``-ERR``), not
    yet connected, for code that drives a connection of its own (the Spark data source)."""
    return _Client()


class Connection:
    """A NATS connection with its JetStream context and a state the callbacks keep.

    ``state`` is ``connected``, ``reconnecting`` (lost; nats-py retries forever, also after
    a server ``-ERR`` that drops the connection) or ``closed``. Use ``connect()`` to build one.
    """

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self.nc = _Client()
        self.state: State = "connecting"
        self.reconnects = 0
        self.last_error: str | None = None
        self._js: JetStreamContext | None = None
        self._said: str | None = None  # the error logged last while reconnecting
        #: Called with the new state on each loss and recovery (the worker's kill switch).
        self.on_state: list[Callable[[State], None]] = []

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
            self._tell()

    async def _on_reconnected(self) -> None:
        self.state = "connected"
        self.reconnects += 1
        self._said = None
        log.info("reconnected to NATS %s", self._server())
        self._tell()
        self.nc.wake_direct()

    def _tell(self) -> None:
        for listener in self.on_state:
            listener(self.state)

    async def _on_error(self, exc: Exception) -> None:
        text = one_line(exc, 300)
        # Each reconnect attempt fails alike while the server is away: said once.
        repeated = self.state == "reconnecting" and text == self._said
        self.last_error = self._said = text
        # While connecting, connect() reports the failure itself; keep the log quiet.
        level = logging.DEBUG if self.state == "connecting" or repeated else logging.WARNING
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
                await close_bounded(self.nc)
        except Exception as exc:  # closing must not fail the caller's shutdown
            log.warning("closing NATS connection: %s", one_line(exc, 300))
            await close_bounded(self.nc)
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
        await attempt_connect(
            self.nc,
            [u.strip() for u in self.url.split(",")],
            connect_timeout=settings.connect_timeout,
            error_cb=self._on_error,
            secrets=settings.secrets,
            name=self.name,
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
        await check_inbox(self.nc, settings.connect_timeout)


async def connect(
    settings: Settings | None = None, *, url: str | None = None, name: str = "meshforge"
) -> Connection:
    """Connect with ``settings.connect_attempts`` tries (exponential backoff with jitter).

    The URL is ``url``, else ``settings.nats_url``, else ``nats://127.0.0.1:4222``; several
    servers may be given separated by commas. Once connected, the client reconnects
    forever. Each retry logs one warning line; ``ConnectionFailed`` names the URL (never
    its credentials) and the last error. A refused login or a certificate problem fails
    at once (retrying cannot help); every attempt and close is bounded, so this returns
    or raises within about ``connect_timeout x connect_attempts`` plus the backoff.

    Example::

        conn = await connect(url="nats://127.0.0.1:4222")
        await conn.close()
    """
    settings = settings if settings is not None else load_settings()
    target = url or settings.nats_url or DEFAULT_URL
    options = nats_auth_options(settings)

    async def once() -> Connection:
        conn = Connection(target, name)
        await conn._attempt(settings, options)
        return conn

    conn = await retry_connect(target, settings.connect_attempts, once, secrets=settings.secrets)
    log.info("connected to NATS %s", conn._server())
    return conn
