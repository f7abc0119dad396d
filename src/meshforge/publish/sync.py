"""``SyncPublisher``: publish from threads and web apps (Django, Flask, any WSGI server).

One background event loop (``meshforge.transport.bridge.LoopThread``, as the Spark data
source has) runs one connection and one ``Publisher``; ``publish`` hands the message to
it and blocks until the PubAck (or the error). Any number of threads may call it at once.
At most ``max_pending`` messages wait at a time: a caller beyond that waits for a slot (up
to its timeout), so a stalled server slows callers down instead of filling memory. The
loop starts on first use; it is closed at interpreter exit, and a child process after
``fork`` (gunicorn, uWSGI) starts its own loop and connection on its first publish
instead of using the parent's.

Example::

    publisher = SyncPublisher(nats_url="nats://127.0.0.1:4222")

    def view(request):
        result = publisher.publish("cmd.default.shop.order.create", {"sku": "A-1", "qty": 2})
        return {"seq": result.seq}

    def typed_view(request):  # subject and type from the agent's declaration
        result = publisher.send(OrderAgent, CreateOrder(sku="A-1", qty=2), namespace="shop")
        return {"seq": result.seq}
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

from meshforge.config import Settings, load_settings
from meshforge.envelope import Envelope
from meshforge.errors import MalformedMessage, PublishError
from meshforge.publish.publisher import Publisher, PublishResult
from meshforge.publish.typed import addressed
from meshforge.transport.bridge import BridgeClosed, BridgeTimeout, LoopThread
from meshforge.transport.connection import Connection, connect

__all__ = ["SyncPublisher", "envelope_for"]

_LIVE: weakref.WeakSet[SyncPublisher] = weakref.WeakSet()


def envelope_for(
    subject: str, payload: Mapping[str, Any], *, source: str = "meshforge"
) -> Envelope:
    """A new envelope for ``payload`` whose type comes from a ``cmd``/``evt`` subject.

    >>> envelope_for("cmd.default.shop.order.create", {"sku": "A-1"}).type
    'order.create'
    """
    tokens = subject.split(".")
    if tokens[0] not in ("cmd", "evt") or len(tokens) < 5:
        raise MalformedMessage(
            f"cannot derive a type from subject {subject!r}: publish an Envelope, or use a "
            "cmd.<tenant>.<ns>.<agent>.<command> or evt.<tenant>.<ns>.<agent>.<event> subject"
        )
    # A partitioned command's sixth token is its partition, not part of the type.
    verb = (
        tokens[4]
        if tokens[0] == "cmd" and len(tokens) == 6 and tokens[5].isdigit()
        else ".".join(tokens[4:])
    )
    return Envelope.new(f"{tokens[3]}.{verb}", payload, source=source, tenant_id=tokens[1])


class SyncPublisher:
    """A thread-safe, blocking publisher; see the module docstring.

    ``settings`` (default ``load_settings()``) gives the server, credentials and retry
    policy; ``nats_url`` overrides the server. ``timeout`` bounds each ``publish`` call
    (waiting for a slot, the retries and the PubAck) unless the call gives its own.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        nats_url: str | None = None,
        max_pending: int = 1024,
        timeout: float = 30.0,
        name: str = "meshforge-sync",
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.settings = settings if settings is not None else load_settings()
        self.nats_url = nats_url
        self.max_pending = max_pending
        self.timeout = timeout
        self.name = name
        self._slots = threading.BoundedSemaphore(max_pending)
        self._bridge = LoopThread(name)
        self._conn: Connection | None = None
        self._publisher: Publisher | None = None
        self._connecting: asyncio.Lock | None = None
        _LIVE.add(self)

    # ------------------------------------------------------------------ public
    def publish(
        self,
        subject: str,
        data: Envelope | bytes | Mapping[str, Any],
        *,
        headers: dict[str, str] | None = None,
        msg_id: str | None = None,
        timeout: float | None = None,
    ) -> PublishResult:
        """Publish and wait for the PubAck; raise ``PublishError`` (or ``ConnectionFailed``).

        ``data`` is an ``Envelope``, bytes as they are, or a payload dict made into an
        envelope whose type comes from the subject (``cmd.<t>.<ns>.<agent>.<command>``).
        """
        if isinstance(data, Mapping):
            data = envelope_for(subject, data, source=self.name)
        limit = self.timeout if timeout is None else timeout
        if not self._slots.acquire(timeout=limit):
            raise PublishError(
                f"publish to {subject!r}: {self.max_pending} messages already waiting for "
                f"their PubAck for {limit:g}s",
                kind="backpressure",
                retriable=True,
            )
        try:
            return self._bridge.run(self._publish(subject, data, headers, msg_id), limit)
        except BridgeClosed:
            raise PublishError("the SyncPublisher is closed", kind="closed") from None
        except BridgeTimeout:
            raise PublishError(
                f"publish to {subject!r}: no PubAck within {limit:g}s",
                kind="timeout",
                retriable=True,
            ) from None
        finally:
            self._slots.release()

    def send(
        self,
        agent: object,
        payload: Any,
        *,
        tenant: str | None = None,
        namespace: str | None = None,
        resource_id: str | None = None,
        timeout: float | None = None,
        **envelope_fields: Any,
    ) -> PublishResult:
        """``Publisher.send``, blocking: typed ``payload`` to the command of agent class
        ``agent`` that declares its type, on the subject that declaration gives."""
        subject, env = addressed(
            agent, payload, self.settings, tenant=tenant, namespace=namespace,
            resource_id=resource_id, source=envelope_fields.pop("source", self.name),
            **envelope_fields,
        )  # fmt: skip
        return self.publish(subject, env, timeout=timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Close the connection (waiting for what is in flight) and stop the thread. Idempotent."""
        self._bridge.close(timeout, last=self._shutdown)

    @property
    def closed(self) -> bool:
        return self._bridge.closed

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ on the loop
    async def _publish(
        self,
        subject: str,
        data: Envelope | bytes,
        headers: dict[str, str] | None,
        msg_id: str | None,
    ) -> PublishResult:
        publisher = self._publisher
        if publisher is None:
            if self._connecting is None:
                self._connecting = asyncio.Lock()
            async with self._connecting:  # the first callers share one connection
                if self._publisher is None:
                    self._conn = await connect(self.settings, url=self.nats_url, name=self.name)
                    self._publisher = Publisher(self._conn.js, self.settings)
                publisher = self._publisher
        return await publisher.publish(subject, data, headers=headers, msg_id=msg_id)

    async def _shutdown(self) -> None:
        conn, self._conn, self._publisher = self._conn, None, None
        if conn is not None:
            await conn.close()


def _close_all() -> None:
    for publisher in list(_LIVE):
        publisher.close(timeout=5.0)


def _after_fork_in_child() -> None:
    for publisher in list(_LIVE):
        # Another parent thread may have held a slot at the fork: the child gets fresh ones.
        publisher._slots = threading.BoundedSemaphore(publisher.max_pending)
        # The parent's connection lives on the parent's loop (the bridge forgets it too).
        publisher._conn = publisher._publisher = publisher._connecting = None


atexit.register(_close_all)
os.register_at_fork(after_in_child=_after_fork_in_child)
