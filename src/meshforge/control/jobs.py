"""Jobs: one command rolled out to many nodes, with the job's state kept in JetStream.

The KV bucket ``MESHFORGE_JOBS`` holds, per job, ``spec.<job>`` (what to send, to whom,
how fast), ``status.<job>`` (running, completed, aborted, canceled), ``cancel.<job>``
(present once canceled), ``lease.<job>`` (the controller driving it) and one ``node.<job>.<site>.<node>`` per target with its state.
Nothing lives only in a process: a controller started again reads the bucket and goes on.
A node's command id is derived from the job, the node and the attempt, so a re-send
after a crash is the same command (the server's duplicate window, then the node's reply
log, keep it from running twice).

Example::

    store = await JobStore.open(conn.js)
    await store.create(JobSpec.new("fw-7", "echo", {"v": 7}, targets=[("plant3", "valve12")]))
    print((await store.nodes("fw-7"))["plant3.valve12"].state)
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from meshforge.envelope import now_ts
from meshforge.errors import ConfigError, MeshForgeError
from meshforge.topology.subjects import JOBS_BUCKET, validate_token
from meshforge.transport.buckets import key_value
from meshforge.transport.listing import read_bucket

__all__ = [
    "FAILED_STATES",
    "JOBS_BUCKET",
    "JOB_STATES",
    "NODE_STATES",
    "TERMINAL",
    "JobSpec",
    "JobStore",
    "NodeJob",
    "NodeState",
    "attempt_id",
    "job_canceled",
    "jobs_bucket",
]

NodeState = Literal[
    "QUEUED", "IN_PROGRESS", "SUCCEEDED", "FAILED", "TIMED_OUT", "REJECTED", "EXPIRED", "CANCELED"
]
NODE_STATES: tuple[NodeState, ...] = (
    "QUEUED", "IN_PROGRESS", "SUCCEEDED", "FAILED", "TIMED_OUT", "REJECTED", "EXPIRED", "CANCELED",
)  # fmt: skip
TERMINAL = frozenset(NODE_STATES) - {"QUEUED", "IN_PROGRESS"}
# What counts against --abort-after: the node did not do what the job asked.
FAILED_STATES = frozenset({"FAILED", "TIMED_OUT", "REJECTED", "EXPIRED"})
JOB_STATES = ("running", "completed", "aborted", "canceled")
# Fixed namespace: the same job, node and attempt always give the same command id.
_NAMESPACE = uuid.UUID("6f1d6c1e-6a0b-4c55-9d1e-2f0c8a7b3e11")


def attempt_id(job: str, site: str, node: str, attempt: int) -> str:
    """The command id of ``attempt`` (1, 2, ...) of ``job`` on ``site.node``: deterministic."""
    return str(uuid.uuid5(_NAMESPACE, f"{job}/{site}.{node}/{attempt}"))


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a job sends, to whom and how: fixed when the job is created."""

    job: str
    command: str
    payload: dict[str, Any]
    targets: list[tuple[str, str]]
    rate: float | None = None  # commands per minute; None: as fast as they go
    abort_after: float | None = None  # percent failed (of those done) that stops sending
    min_done: int = 1  # how many must be done before abort_after is judged
    deadline: str | None = None  # RFC 3339: not run after this (and the letter expires)
    not_before: str | None = None  # RFC 3339: not run before this
    retries: int = 0  # re-sends (new attempt id) after FAILED or TIMED_OUT
    timeout: float | None = None  # seconds an attempt may stay IN_PROGRESS before TIMED_OUT
    created_at: str = field(default_factory=now_ts)

    def __post_init__(self) -> None:
        validate_token(self.job, "job")
        validate_token(self.command, "command")
        if not self.targets:
            raise ConfigError(f"job {self.job}: no target nodes")
        for site, node in self.targets:
            validate_token(site, "site")
            validate_token(node, "node")
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"job {self.job}: a target node is listed twice")
        if self.rate is not None and self.rate <= 0:
            raise ConfigError(f"rate: expected commands per minute > 0, got {self.rate!r}")
        if self.abort_after is not None and not 0 < self.abort_after <= 100:
            raise ConfigError(
                f"abort_after: expected a percentage in (0, 100], got {self.abort_after!r}"
            )
        if self.min_done < 1 or self.retries < 0:
            raise ConfigError("min_done must be >= 1 and retries >= 0")
        if self.timeout is not None and self.timeout <= 0:
            raise ConfigError(f"timeout: expected seconds > 0, got {self.timeout!r}")

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> JobSpec:
        obj = json.loads(data)
        obj["targets"] = [(str(s), str(n)) for s, n in obj["targets"]]
        return cls(**obj)


@dataclass(frozen=True, slots=True)
class NodeJob:
    """One target's part of a job: its state, the attempt and what the node answered."""

    site: str
    node: str
    state: NodeState = "QUEUED"
    attempt: int = 0  # the attempt sent last (0: none yet)
    command_id: str | None = None
    sent_at: str | None = None
    updated_at: str = field(default_factory=now_ts)
    result: Any = None
    error: str | None = None
    node_epoch: int | None = None
    by_reply: bool = False  # the state is the node's answer (not the controller's verdict)

    @property
    def key(self) -> str:
        return f"{self.site}.{self.node}"

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def to(self, state: NodeState, **changes: Any) -> NodeJob:
        """This record in ``state`` (and ``changes``), stamped now."""
        return replace(self, state=state, updated_at=now_ts(), **changes)

    def encode(self) -> bytes:
        # Field by field: asdict() deep-copies every value, and a rollout writes a record
        # twice per node.
        fields = {name: getattr(self, name) for name in self.__slots__}
        return json.dumps(fields, separators=(",", ":"), default=str).encode()

    @classmethod
    def decode(cls, data: bytes) -> NodeJob:
        return cls(**json.loads(data))


async def jobs_bucket(js: JetStreamContext, *, create: bool, replicas: int = 1) -> KeyValue | None:
    """The ``MESHFORGE_JOBS`` bucket; created when missing and ``create`` (else None)."""
    config = KeyValueConfig(
        bucket=JOBS_BUCKET,
        description="MeshForge jobs: spec, status and per-node state",
        history=1,
        storage=StorageType.FILE,
        replicas=replicas,
    )
    return await key_value(js, config, create=create)


async def job_canceled(js: JetStreamContext, job: str) -> bool:
    """Whether ``job`` was canceled (what a node asks before running a job's command)."""
    kv = await jobs_bucket(js, create=False)
    if kv is None:
        return False
    try:
        await kv.get(f"cancel.{job}")
    except KeyNotFoundError:
        return False
    return True


class JobStore:
    """The jobs bucket: create, read and update jobs and their nodes' states."""

    def __init__(self, kv: KeyValue, js: JetStreamContext) -> None:
        self.kv = kv
        self.js = js

    @classmethod
    async def open(cls, js: JetStreamContext, *, create: bool = True) -> JobStore:
        kv = await jobs_bucket(js, create=create)
        if kv is None:
            raise MeshForgeError(f"no jobs yet (the bucket {JOBS_BUCKET} does not exist)")
        return cls(kv, js)

    async def create(self, spec: JobSpec) -> None:
        """Store a new job with every node QUEUED; refuses a job name already used."""
        try:
            await self.kv.create(f"spec.{spec.job}", spec.encode())
        except KeyWrongLastSequenceError:
            raise MeshForgeError(f"job {spec.job} exists already; pick another name") from None
        for site, node in spec.targets:
            await self.put_node(spec.job, NodeJob(site, node))
        await self.set_status(spec.job, "running")

    async def spec(self, job: str) -> JobSpec:
        try:
            entry = await self.kv.get(f"spec.{validate_token(job, 'job')}")
        except KeyNotFoundError:
            raise MeshForgeError(f"no job {job}") from None
        return JobSpec.decode(entry.value or b"")

    async def put_node(self, job: str, record: NodeJob) -> None:
        await self.kv.put(f"node.{job}.{record.site}.{record.node}", record.encode())

    @staticmethod
    def node_subject(job: str, record: NodeJob) -> str:
        """Where ``put_node`` writes ``record``: a controller publishes its writes there
        itself, many in flight at once, instead of waiting for each."""
        return f"$KV.{JOBS_BUCKET}.node.{job}.{record.site}.{record.node}"

    async def nodes(self, job: str) -> dict[str, NodeJob]:
        """Every target's record, by ``<site>.<node>`` (one listing, never silently short)."""
        records = [NodeJob.decode(v) for v in await self._read(f"node.{job}.>")]
        return {record.key: record for record in records}

    async def _read(self, keys: str) -> list[bytes]:
        """The values of the live keys matching ``keys``, in key order."""
        entries = await read_bucket(self.js, JOBS_BUCKET, keys)
        return [entries[key].data for key in sorted(entries) if entries[key].data]

    async def set_status(self, job: str, status: str, reason: str | None = None) -> None:
        body = {"status": status, "reason": reason, "at": now_ts()}
        await self.kv.put(f"status.{job}", json.dumps(body).encode())

    async def status(self, job: str) -> dict[str, Any]:
        try:
            entry = await self.kv.get(f"status.{job}")
        except KeyNotFoundError:
            return {"status": "running", "reason": None, "at": None}
        result: dict[str, Any] = json.loads(entry.value or b"{}")
        return result

    async def cancel(self, job: str) -> None:
        """Mark ``job`` canceled: no more sends; nodes answer CANCELED to its commands."""
        await self.spec(job)  # a clear error for an unknown job
        await self.kv.put(f"cancel.{job}", now_ts().encode())

    async def canceled(self, job: str) -> bool:
        try:
            await self.kv.get(f"cancel.{job}")
        except KeyNotFoundError:
            return False
        return True

    async def take_lease(self, job: str, owner: str, ttl: float) -> int | None:
        """Hold ``job``'s controller lease for ``ttl`` s: its revision, or None while another
        live controller holds it (one controller drives a job at a time)."""
        key = f"lease.{job}"
        body = json.dumps({"owner": owner, "until": time.time() + ttl}).encode()
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            entry = None
        try:
            if entry is None or not entry.value:
                return await self.kv.create(key, body)
            held = json.loads(entry.value)
            if held.get("owner") != owner and float(held.get("until", 0)) > time.time():
                return None
            assert entry.revision is not None
            return await self.kv.update(key, body, last=entry.revision)
        except KeyWrongLastSequenceError:  # another controller took it just now
            return None

    async def renew_lease(self, job: str, owner: str, ttl: float, revision: int) -> int:
        """Extend the lease this controller holds; raises if another one took it over."""
        body = json.dumps({"owner": owner, "until": time.time() + ttl}).encode()
        try:
            return await self.kv.update(f"lease.{job}", body, last=revision)
        except KeyWrongLastSequenceError:
            raise MeshForgeError(f"job {job}: another controller took the job over") from None

    async def drop_lease(self, job: str, revision: int) -> None:
        """Give the lease up (a controller that ends), so the next one need not wait it out."""
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self.kv.delete(f"lease.{job}", last=revision)

    async def jobs(self) -> list[JobSpec]:
        """Every job, oldest first."""
        specs = [JobSpec.decode(v) for v in await self._read("spec.*")]
        return sorted(specs, key=lambda s: s.created_at)
