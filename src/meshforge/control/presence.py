"""Presence: a node announces itself (epoch, version, start time) in a JetStream KV bucket.

The bucket ``MESHFORGE_NODES`` holds one key per node, ``<site>.<node>``, with the
latest announcement as JSON. A node writes it when it starts, after a (simulated)
restart and every ``interval`` seconds, so ``meshforge ctl status`` and
``--expect-epoch`` have something to go on.

Example::

    presence = Presence(conn.js, "lab1", "node7", version="0.1.0", interval=10)
    await presence.announce(epoch=3, started_at=now_ts())
    presence.start(runtime.current_epoch)        # re-announce every 10 s
    seen = await read_announcement(conn.js, "lab1", "node7")
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from meshforge.envelope import now_ts
from meshforge.errors import one_line
from meshforge.topology.subjects import NODES_BUCKET, validate_token
from meshforge.transport.buckets import key_value

__all__ = [
    "NODES_BUCKET",
    "Announcement",
    "Presence",
    "nodes_bucket",
    "presence_key",
    "read_announcement",
]

log = logging.getLogger("meshforge.control.presence")

# A node not heard from for this many intervals is reported as not alive.
STALE_INTERVALS = 3


def presence_key(site: str, node: str) -> str:
    """The KV key of a node: ``<site>.<node>``."""
    return f"{validate_token(site, 'site')}.{validate_token(node, 'node')}"


def _parse_ts(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Announcement:
    """What a node says about itself; ``last_seen`` is when it said it."""

    site: str
    node: str
    epoch: int
    version: str
    started_at: str
    last_seen: str
    interval: float
    instance: str
    host: str
    state: str = "up"

    def age(self, now: datetime | None = None) -> float:
        """Seconds since ``last_seen``."""
        now = now or datetime.now(UTC)
        return (now - _parse_ts(self.last_seen)).total_seconds()

    def alive(self, now: datetime | None = None) -> bool:
        """Up, and heard from within the last few announcement intervals."""
        return self.state == "up" and self.age(now) <= STALE_INTERVALS * self.interval

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Announcement | None:
        """Parse an announcement; None when the value is not one (never raises)."""
        try:
            obj: Any = json.loads(data)
            return cls(
                site=str(obj["site"]),
                node=str(obj["node"]),
                epoch=int(obj["epoch"]),
                version=str(obj.get("version", "")),
                started_at=str(obj["started_at"]),
                last_seen=str(obj["last_seen"]),
                interval=float(obj.get("interval", 10.0)),
                instance=str(obj.get("instance", "")),
                host=str(obj.get("host", "")),
                state=str(obj.get("state", "up")),
            )
        except (ValueError, KeyError, TypeError):
            return None


async def nodes_bucket(js: JetStreamContext, *, create: bool, replicas: int = 1) -> KeyValue | None:
    """The ``MESHFORGE_NODES`` bucket; created when missing and ``create`` (else None)."""
    config = KeyValueConfig(
        bucket=NODES_BUCKET,
        description="MeshForge node presence: the latest announcement per <site>.<node>",
        history=1,
        storage=StorageType.FILE,
        replicas=replicas,
    )
    return await key_value(js, config, create=create)


async def read_announcement(js: JetStreamContext, site: str, node: str) -> Announcement | None:
    """The node's latest announcement, or None if it never announced (or no bucket exists)."""
    key = presence_key(site, node)
    try:
        kv = await js.key_value(NODES_BUCKET)
        entry = await kv.get(key)
    except (BucketNotFoundError, KeyNotFoundError, NotFoundError):
        return None
    return Announcement.decode(entry.value or b"")


class Presence:
    """Writes one node's announcements; ``start`` keeps them coming every ``interval`` seconds.

    Failures to write are logged and retried at the next tick: presence never stops a node.
    """

    def __init__(
        self,
        js: JetStreamContext,
        site: str,
        node: str,
        *,
        version: str,
        interval: float = 10.0,
        replicas: int = 1,
        create: bool = True,
    ) -> None:
        self.js = js
        self.site = site
        self.node = node
        self.key = presence_key(site, node)
        self.version = version
        self.interval = interval
        self.replicas = replicas
        self.create = create
        self.instance = uuid.uuid4().hex[:12]
        self.host = f"{socket.gethostname()}:{os.getpid()}"
        self.started_at = now_ts()
        self.last: Announcement | None = None
        self._kv: KeyValue | None = None
        self._task: asyncio.Task[None] | None = None

    async def announce(
        self, epoch: int, *, started_at: str | None = None, state: str = "up"
    ) -> Announcement | None:
        """Write the announcement now; returns it, or None if it could not be written.
        ``state`` is ``up``, or ``stopped`` for the last word of a node shutting down."""
        if started_at is not None:
            self.started_at = started_at
        note = Announcement(
            site=self.site,
            node=self.node,
            epoch=epoch,
            version=self.version,
            started_at=self.started_at,
            last_seen=now_ts(),
            interval=self.interval,
            instance=self.instance,
            host=self.host,
            state=state,
        )
        try:
            if self._kv is None:
                self._kv = await nodes_bucket(self.js, create=self.create, replicas=self.replicas)
            if self._kv is None:
                log.warning("presence bucket %s does not exist; not announcing", NODES_BUCKET)
                return None
            await self._kv.put(self.key, note.encode())
        except Exception as exc:  # a lost connection or a missing bucket must not stop the node
            log.warning("announcing %s failed: %s", self.key, one_line(exc, 300))
            return None
        self.last = note
        return note

    def start(self, epoch: Callable[[], Awaitable[int]]) -> None:
        """Announce every ``interval`` seconds with the epoch ``await epoch()`` gives then."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(epoch), name=f"presence-{self.key}")

    async def _loop(self, epoch: Callable[[], Awaitable[int]]) -> None:
        while True:
            await asyncio.sleep(self.interval)  # the announcement period itself
            await self.announce(await epoch())

    async def stop(self, epoch: int | None = None) -> None:
        """Stop announcing; with ``epoch``, announce a last time that the node stopped."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if epoch is not None and self.last is not None:
            await self.announce(epoch, state="stopped")
