"""Partitioned commands: which partition a command goes to, and which worker owns which.

With ``partitions = N`` (``MESHFORGE_PARTITIONS``) a command to an agent carries a sixth
subject token, ``cmd.<tenant>.<ns>.<agent>.<command>.<p>``, where ``p`` is the FNV-1a
32-bit hash of the envelope's ``resource_id`` (UTF-8 bytes; the ``id`` when there is no
resource id) modulo N: the same hash nats-server's ``partition()`` subject mapping uses,
so a publisher in any language computes the same partition. Each partition has its own
durable; a worker runs the durables it owns, so each resource's commands are applied by
one worker at a time, in the order they were stored.

Ownership lives in the JetStream key-value bucket ``MESHFORGE_PARTITIONS`` (its TTL is the
lease, ``partition_lease``): one key per partition names its owner, and one key per live
worker lets each compute its fair share. ``Leases`` claims free partitions, renews its own
every third of the lease, hands back those above its share (after their in-flight work is
acknowledged) and drops at once a partition whose renewal fails. A dead worker's keys
expire after the lease and the others take its partitions.

A lease cannot stop a worker that stalled past it (a paused VM) from fetching again
before it notices; the server can. Each partition durable has a priority group with
policy pinned_client (nats-server >= 2.11): the server delivers to one client at a time,
the pinned one, whose pulls carry the pin id it was given. A worker that claims a
partition ``unpin``s the group before its first pull, so every pull of the previous
owner is refused from then on (status 423, and the previous owner drops the partition).

Example::

    >>> partition_of("order-7", 4)
    3
    >>> partition_subject("cmd.default.demo.order.create", "order-7", 4)
    'cmd.default.demo.order.create.3'
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import APIError, BucketNotFoundError, KeyDeletedError, KeyNotFoundError

from meshforge.config import Settings
from meshforge.envelope import Envelope
from meshforge.errors import MissingTopology, one_line
from meshforge.topology.specs import js_api
from meshforge.topology.subjects import command_parts, partitioned_command_subject
from meshforge.transport.buckets import key_value

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = [
    "BUCKET",
    "Leases",
    "ensure_bucket",
    "fnv1a_32",
    "open_bucket",
    "partition_key",
    "partition_of",
    "partition_subject",
    "partitioned",
    "pinned_client",
    "unpin",
    "worker_id",
]

log = logging.getLogger("meshforge.partitions")

BUCKET = "MESHFORGE_PARTITIONS"
_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


def fnv1a_32(data: bytes) -> int:
    """The 32-bit FNV-1a hash of ``data`` (as Go's ``hash/fnv`` ``New32a``).

    >>> hex(fnv1a_32(b"foobar"))
    '0xbf9cf968'
    """
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return h


def partition_of(key: str, partitions: int) -> int:
    """The partition of an ordering key: ``fnv1a_32(key as UTF-8) % partitions``."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return fnv1a_32(key.encode()) % partitions


def partition_key(env: Envelope) -> str:
    """What a command is partitioned by: its ``resource_id``, else its ``id`` (no order then)."""
    return env.resource_id or env.id


def partition_subject(subject: str, key: str, partitions: int) -> str:
    """A five-token command subject with its partition token added (when ``partitions`` > 0).

    Anything else (an event, a subject already partitioned, ``partitions`` 0) is returned as is.
    """
    parts = command_parts(subject)
    if partitions < 1 or parts is None or parts[4] is not None:
        return subject
    tenant, namespace, agent, command, _ = parts
    return partitioned_command_subject(
        tenant, namespace, agent, command, partition_of(key, partitions)
    )


def partitioned(subject: str, env: Envelope, settings: Settings) -> str:
    """``partition_subject`` for an envelope, with the deployment's ``settings.partitions``."""
    return partition_subject(subject, partition_key(env), settings.partitions)


def worker_id() -> str:
    """A fresh id for one worker process: host, pid and a random part (KV-key safe)."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:24]
    return f"{host or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"


# ------------------------------------------------------------------ the bucket


async def ensure_bucket(js: JetStreamContext, settings: Settings) -> KeyValue:
    """Create the ownership bucket (TTL ``settings.partition_lease``) or align its TTL; idempotent."""
    lease = settings.partition_lease
    config = KeyValueConfig(
        bucket=BUCKET, description="MeshForge partition ownership", history=1, ttl=lease,
        storage=StorageType(settings.storage), replicas=settings.replicas,
    )  # fmt: skip
    kv = await key_value(js, config)
    assert kv is not None  # created when missing
    status = await kv.status()
    if status.ttl != lease:
        stream = status.stream_info.config
        stream.max_age = lease
        stream.duplicate_window = min(stream.duplicate_window or lease, lease)
        await js.update_stream(stream)
        log.info("partition bucket: lease %gs -> %gs", status.ttl or 0, lease)
    return kv


async def open_bucket(js: JetStreamContext) -> KeyValue:
    """The ownership bucket, which must exist (``meshforge provision --partitions N`` makes it)."""
    try:
        return await js.key_value(BUCKET)
    except BucketNotFoundError:
        raise MissingTopology(
            f"key-value bucket {BUCKET} is missing: run `meshforge provision --partitions N "
            "--agent NAME` or let the worker provision"
        ) from None


async def lease_of(kv: KeyValue) -> float:
    """The bucket's TTL: how long an unrenewed lease lives."""
    status = await kv.status()
    return float(status.ttl or 0) or Settings().partition_lease


# ------------------------------------------------------------------ the server's fence


async def unpin(js: JetStreamContext, stream: str, durable: str, group: str) -> None:
    """Revoke the durable's pin: pulls carrying it are refused (423) from now on, and the
    next pull without one is pinned. Raises ``MissingTopology`` when the durable has no
    such group (provisioned by an older MeshForge, or a server before 2.11)."""
    try:
        await js_api(js, f"CONSUMER.UNPIN.{stream}.{durable}", {"group": group})
    except APIError as exc:
        raise MissingTopology(
            f"cannot unpin consumer {stream}/{durable} (group {group!r}): {one_line(exc)}; partition "
            "durables need their priority group (nats-server >= 2.11): run `meshforge provision "
            "--partitions N --agent NAME`"
        ) from None


async def pinned_client(js: JetStreamContext, stream: str, durable: str, group: str) -> str | None:
    """The pin id the server has given out for ``group`` (None: no client is pinned)."""
    info = await js_api(js, f"CONSUMER.INFO.{stream}.{durable}")
    for state in info.get("priority_groups") or []:
        if state.get("group") == group:
            return state.get("pinned_client_id") or None
    return None


# ------------------------------------------------------------------ ownership


class Leases:
    """One worker's share of one group's slots (a partitioned agent's durables).

    ``start(slot, clean)`` must begin consuming the slot at once and return (``clean``
    False: the slot's last owner did not hand it back, its unacknowledged messages may
    still be on their way back); ``stop(slot)`` stops consuming it, finishing and
    acknowledging its in-flight work; ``fence(slot)``, when given, is called first when a
    renewal failed (someone else may own the slot: stop fetching now). ``lose(slot)`` is
    for the consumer to say it was fenced by the server. ``step`` is one round; ``run``
    repeats it every ``period`` seconds; ``close`` hands everything back.

    The fair share counts ``slots`` but not the ``spare`` ones among them: a spare slot
    (the unpartitioned durable, which only commands published without a partition token
    reach) goes to whichever worker finds it free and is never handed back to even out
    the shares, so 16 partitions over two workers split 8 and 8, not 9 and 7 with the
    spare in the smaller share.
    """

    def __init__(
        self,
        js: JetStreamContext,
        kv: KeyValue,
        group: str,
        slots: Sequence[str],
        *,
        start: Callable[[str, bool], object],
        stop: Callable[[str], Awaitable[None]],
        period: float,
        worker: str | None = None,
        fence: Callable[[str], None] | None = None,
        spare: Sequence[str] = (),
    ) -> None:
        self.js = js
        self.kv = kv
        self.group = group
        self.spare = list(spare)
        self.slots = [s for s in slots if s not in self.spare]
        self.worker = worker or worker_id()
        self.period = period
        self._start = start
        self._stop = stop
        self._fence = fence
        self.owned: dict[str, int] = {}  # slot -> revision of our lease key
        self._handing_back: dict[str, asyncio.Task[None]] = {}
        self._dropping: set[asyncio.Task[None]] = set()
        # Workers try free slots from different places, so they rarely race for one.
        offset = zlib.crc32(self.worker.encode()) % max(1, len(self.slots))
        self._order = self.slots[offset:] + self.slots[:offset]

    def _lease_key(self, slot: str) -> str:
        return f"lease.{self.group}.{slot}"

    @property
    def _worker_key(self) -> str:
        return f"worker.{self.group}.{self.worker}"

    async def run(self, first_round: asyncio.Event | None = None) -> None:
        """Run rounds until cancelled (a failed round is logged and tried again next period)."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.step()
            except Exception as exc:  # the server may be away: keep what renews, retry
                log.warning("%s: partition ownership round failed: %s", self.group, one_line(exc))
            if first_round is not None:
                first_round.set()
            # A round every period from the start of the last: a slow round (a busy worker)
            # must not push the next renewal towards the end of the lease.
            await asyncio.sleep(max(self.period / 4, self.period - (loop.time() - started)))

    async def step(self) -> None:
        """Register, renew, then hand back what is above the fair share or claim up to it."""
        await self._renew()
        await self.kv.put(self._worker_key, self.worker.encode())
        await self._finish_handbacks()
        share = math.ceil(len(self.slots) / max(1, await self.live_workers()))
        kept = [s for s in self.slots if s in self.owned and s not in self._handing_back]
        if len(kept) > share:
            for slot in kept[share:]:
                log.info("%s: handing back %s (share %d)", self.group, slot, share)
                self._handing_back[slot] = asyncio.ensure_future(self._stop(slot))
        elif len(kept) < share:
            await self._claim(self._order, share - len(kept))
        await self._claim(self.spare, len(self.spare))  # skips what is ours already

    async def live_workers(self) -> int:
        """Workers of this group whose registration has not expired."""
        # The stream's per-subject counts name the registrations (a delete marker too):
        # one read each tells which still live. Cheaper than a watcher every round.
        pre = f"$KV.{BUCKET}."
        info = await self.js.stream_info(
            f"KV_{BUCKET}", subjects_filter=f"{pre}{self._worker_key.rsplit('.', 1)[0]}.*"
        )
        live = 0
        for subject in (info.state.subjects or {}) if info.state else {}:
            with contextlib.suppress(KeyNotFoundError, KeyDeletedError):
                await self.kv.get(subject.removeprefix(pre))
                live += 1
        return max(1, live)

    async def _renew(self) -> None:
        # All at once: one round trip for every lease, however many, and however slow each
        # is while the worker is busy (one after the other, the last could expire first).
        owned = list(self.owned.items())
        renewals = [self.kv.update(self._lease_key(slot), self.worker.encode(), last=revision)
                    for slot, revision in owned]  # fmt: skip
        results = await asyncio.gather(*renewals, return_exceptions=True)
        for (slot, _), result in zip(owned, results, strict=True):
            if slot not in self.owned:
                continue  # fenced off meanwhile (``lose``): already dropped
            if isinstance(result, int):
                self.owned[slot] = result
                continue
            if not isinstance(result, Exception):
                raise result
            # Someone may own it now: stop fetching at once.
            log.warning("%s: lost %s (renewal failed: %s)", self.group, slot, one_line(result))
            del self.owned[slot]
            if self._fence is not None:
                self._fence(slot)
            self._drop(slot)

    def lose(self, slot: str) -> None:
        """The server fenced our consumer of ``slot`` off (another client was given it):
        stop it and renew it no more. The key is left to expire, or to be taken back by
        the next round if it is still ours (through a new claim, which unpins again)."""
        if self.owned.pop(slot, None) is not None:
            self._drop(slot)

    def _drop(self, slot: str) -> None:
        task = self._handing_back.pop(slot, None) or asyncio.ensure_future(self._stop(slot))
        self._dropping.add(task)
        task.add_done_callback(self._dropping.discard)

    async def _finish_handbacks(self) -> None:
        for slot, task in list(self._handing_back.items()):
            if not task.done():
                continue
            del self._handing_back[slot]
            revision = self.owned.pop(slot, None)
            if revision is not None:
                with contextlib.suppress(Exception):  # else it expires after the lease
                    await self.kv.delete(self._lease_key(slot), last=revision)

    async def _claim(self, order: Sequence[str], wanted: int) -> None:
        for slot in order:
            if wanted <= 0:
                return
            if slot in self.owned:
                continue
            key = self._lease_key(slot)
            clean = False
            try:
                entry = await self.kv.get(key)
            except (KeyDeletedError, KeyNotFoundError) as exc:
                # A delete marker: handed back by its owner, nothing left in flight. No key
                # at all: never owned, or its owner's lease expired.
                clean = getattr(exc, "op", None) is not None
            else:
                if entry.value != self.worker.encode() or entry.revision is None:
                    continue
                # Ours still (a renewal failed but the key lived on): take it back.
                with contextlib.suppress(Exception):
                    self.owned[slot] = await self.kv.update(
                        key, self.worker.encode(), last=entry.revision
                    )
                    self._start(slot, False)
                    wanted -= 1
                continue
            try:
                self.owned[slot] = await self.kv.create(key, self.worker.encode())
            except Exception:
                continue  # another worker was quicker
            log.info("%s: claimed %s%s", self.group, slot, "" if clean else " (not handed back)")
            self._start(slot, clean)
            wanted -= 1

    async def close(self) -> None:
        """Stop every owned slot (in-flight work finishes), then delete our keys."""
        for task in list(self._dropping):
            with contextlib.suppress(Exception):
                await task
        stops: list[Awaitable[None]] = []
        for slot in list(self.owned):
            handing = self._handing_back.pop(slot, None)
            stops.append(handing if handing is not None else self._stop(slot))
        await asyncio.gather(*stops, return_exceptions=True)
        for slot, revision in list(self.owned.items()):
            with contextlib.suppress(Exception):
                await self.kv.delete(self._lease_key(slot), last=revision)
        self.owned.clear()
        with contextlib.suppress(Exception):
            await self.kv.delete(self._worker_key)
