"""Stream and consumer specs: the five CONTRACT streams and the agent and node consumers.

A spec says what should exist; ``meshforge.topology.provision`` compares it with the server and
creates, updates or refuses (``plan`` / ``apply`` / ``ensure`` / ``verify``). The parts of a
plan (``Step``, ``Change``, ``Plan``) and how a config is shown live here, so provisioning
imports this module and never the other way round.

Example::

    settings = load_settings()
    streams = default_streams(settings)
    consumers = [agent_consumer("order", settings), node_consumer("lab1", "node7", settings)]
    report = await provision.ensure(conn.js, streams, consumers)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from meshforge.config import Settings
from meshforge.errors import TopologyError
from meshforge.topology.subjects import (
    STREAM_COMMANDS,
    STREAM_CONTROL,
    STREAM_EVENTS,
    STREAM_FAILED,
    STREAM_REPLIES,
    control_command_subject,
    validate_subject,
    validate_token,
)

if TYPE_CHECKING:
    from nats.js import JetStreamManager

__all__ = [
    "OWNER_GROUP",
    "SERVER_DEFAULT_CONSUMERS",
    "UNLIMITED_CONSUMERS",
    "Action",
    "ApplyReport",
    "Change",
    "ConsumerSpec",
    "GroupedConsumerConfig",
    "Plan",
    "Step",
    "StreamSpec",
    "Verification",
    "agent_consumer",
    "agent_durable",
    "consumer_limit",
    "consumer_replicas",
    "default_streams",
    "js_api",
    "node_consumer",
    "partition_consumers",
    "pinned_ttl",
]

Retention = Literal["limits", "workqueue", "interest"]
Storage = Literal["file", "memory"]
Discard = Literal["old", "new"]


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """What one stream should look like. ``max_age`` 0 and ``max_bytes`` -1 mean unlimited.

    >>> StreamSpec("ORDERS", ("orders.>",)).retention
    'limits'
    """

    name: str
    subjects: tuple[str, ...]
    retention: Retention = "limits"
    storage: Storage = "file"
    duplicate_window: float = 120.0
    replicas: int = 1
    max_age: float = 0.0
    max_bytes: int = -1
    discard: Discard = "old"
    description: str = ""
    # Per-message TTL (header Nats-TTL, nats-server 2.11+): a letter leaves when it expires.
    allow_msg_ttl: bool = False
    # Consumers the stream takes (-1: unlimited). Set on purpose, never left to a default:
    # a server refuses the consumer past it, and a node without one never starts.
    max_consumers: int = -1

    def __post_init__(self) -> None:
        for subject in self.subjects:
            validate_subject(subject, wildcards=True)

    def config(self) -> StreamConfig:
        """The nats-py ``StreamConfig`` that creates this stream."""
        return StreamConfig(
            name=self.name,
            description=self.description or None,
            subjects=list(self.subjects),
            retention=RetentionPolicy(self.retention),
            storage=StorageType(self.storage),
            discard=DiscardPolicy(self.discard),
            duplicate_window=self.duplicate_window,
            num_replicas=self.replicas,
            max_age=self.max_age,
            max_bytes=self.max_bytes,
            allow_msg_ttl=self.allow_msg_ttl or None,
            max_consumers=UNLIMITED_CONSUMERS if self.max_consumers < 1 else self.max_consumers,
        )


#: What "unlimited" consumers is written as: the largest limit a stream takes. Since
#: nats-server 2.15 a stream without a limit of its own (0 or -1) gets the server's
#: ``jetstream.limits.default_max_consumers``, 1000 unless configured: a fleet of nodes
#: (one consumer each) would stop at the 1,001st without a word in the stream's config.
UNLIMITED_CONSUMERS = 2**31 - 1
#: The limit nats-server 2.15+ puts on a stream that sets none (its default_max_consumers).
SERVER_DEFAULT_CONSUMERS = 1000


def consumer_limit(max_consumers: int | None) -> int:
    """A stream's consumer limit as the server applies it: -1 for unlimited, else the number
    (a stream that sets none gets nats-server 2.15's default).

    >>> consumer_limit(UNLIMITED_CONSUMERS), consumer_limit(3), consumer_limit(-1)
    (-1, 3, 1000)
    """
    if max_consumers is not None and max_consumers >= UNLIMITED_CONSUMERS:
        return -1
    if max_consumers is not None and max_consumers > 0:
        return max_consumers
    return SERVER_DEFAULT_CONSUMERS


#: The priority group of a partition durable: its one pinned client is the partition's owner.
OWNER_GROUP = "owner"


async def js_api(
    js: JetStreamManager, api: str, request: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One JetStream API call (``api``: the subject after ``$JS.API.``), its answer as raw
    JSON: for the priority-group fields and calls that nats-py's own API does not carry.
    An error answer raises nats-py's ``APIError``, as its API does."""
    body = b"" if request is None else json.dumps(request).encode()
    answer: dict[str, Any] = await js._api_request(f"{js._prefix}.{api}", body, timeout=js._timeout)
    return answer


@dataclass
class GroupedConsumerConfig(ConsumerConfig):
    """A ``ConsumerConfig`` with the priority-group fields (nats-server >= 2.11) that
    nats-py's does not carry: ``priority_groups``, ``priority_policy`` and
    ``priority_timeout`` (the pinned TTL, seconds here, nanoseconds on the wire).

    >>> GroupedConsumerConfig(priority_groups=["owner"], priority_policy="pinned_client",
    ...                       priority_timeout=60.0).as_dict()["priority_timeout"]
    60000000000
    """

    priority_groups: list[str] | None = None
    priority_policy: str | None = None
    priority_timeout: float | None = None

    @classmethod
    def from_response(cls, resp: dict[str, Any]) -> GroupedConsumerConfig:
        cls._convert_nanoseconds(resp, "priority_timeout")
        config: GroupedConsumerConfig = super().from_response(resp)
        return config

    def as_dict(self) -> dict[str, object]:
        result = super().as_dict()
        if self.priority_timeout is not None:
            result["priority_timeout"] = self._to_nanoseconds(self.priority_timeout)
        return result


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    """A durable pull consumer with explicit acks, delivering from the stream's start.

    ``max_deliver`` -1 is unlimited. With a ``backoff`` the server times out each
    delivery after its backoff entry (``ack_wait`` is then only the first entry's
    fallback): a long handler must signal progress (``in_progress``).
    """

    stream: str
    durable: str
    filter_subject: str
    ack_wait: float = 30.0
    max_deliver: int = -1
    backoff: tuple[float, ...] = ()
    description: str = ""
    replicas: int = 0  # 0: as many as the stream (the server's rule)
    # A priority group with policy pinned_client: the server delivers to one client at a
    # time, and refuses (status 423) pulls that carry a pin it has revoked.
    priority_group: str = ""
    pinned_ttl: float = 0.0  # the server unpins a client that has not pulled for this long

    def __post_init__(self) -> None:
        validate_subject(self.filter_subject, wildcards=True)
        if self.backoff and 0 < self.max_deliver <= len(self.backoff):
            # Server rule: MaxDeliver must exceed the number of backoff entries.
            raise TopologyError(
                f"consumer {self.durable}: max_deliver ({self.max_deliver}) must exceed "
                f"the {len(self.backoff)} backoff entries"
            )

    @property
    def name(self) -> str:
        """``STREAM/durable``, how plans and errors name a consumer."""
        return f"{self.stream}/{self.durable}"

    @property
    def effective_ack_wait(self) -> float:
        """The ack wait the server records: the first backoff entry when there is a backoff."""
        return self.backoff[0] if self.backoff else self.ack_wait

    def config(self) -> ConsumerConfig:
        """The nats-py ``ConsumerConfig`` that creates this consumer (a
        ``GroupedConsumerConfig`` when it has a priority group)."""
        if self.priority_group:
            return GroupedConsumerConfig(
                **vars(self._plain_config()), priority_groups=[self.priority_group],
                priority_policy="pinned_client", priority_timeout=self.pinned_ttl,
            )  # fmt: skip
        return self._plain_config()

    def _plain_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.durable,
            description=self.description or None,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            filter_subject=self.filter_subject,
            ack_wait=self.effective_ack_wait,
            max_deliver=self.max_deliver,
            backoff=list(self.backoff) or None,
            num_replicas=self.replicas,
        )


def default_streams(settings: Settings) -> list[StreamSpec]:
    """The five CONTRACT streams, sized by ``settings`` (storage, replicas, limits).

    Work-queue streams and the dead letters refuse new messages when full
    (``discard new``) rather than drop unprocessed ones; events and replies drop the oldest.
    """

    def spec(
        name: str,
        subject: str,
        retention: Retention,
        discard: Discard,
        what: str,
        ttl: bool = False,
        max_consumers: int = -1,
    ) -> StreamSpec:
        return StreamSpec(
            name=name,
            subjects=(subject,),
            retention=retention,
            storage=settings.storage,
            duplicate_window=settings.duplicate_window,
            replicas=settings.replicas,
            max_age=settings.max_age,
            max_bytes=settings.max_bytes,
            discard=discard,
            description=f"MeshForge {what}",
            allow_msg_ttl=ttl,
            max_consumers=max_consumers,
        )

    return [
        spec(STREAM_COMMANDS, "cmd.>", "workqueue", "new", "commands to agents"),
        spec(STREAM_EVENTS, "evt.>", "limits", "old", "events from agents"),
        spec(STREAM_FAILED, "failed.>", "limits", "new", "dead letters"),
        spec(
            STREAM_CONTROL,
            "control.cmd.>",
            "workqueue",
            "new",
            "node mailboxes",
            ttl=True,
            max_consumers=settings.control_max_consumers,
        ),
        spec(STREAM_REPLIES, "control.reply.>", "limits", "old", "node replies"),
    ]


def consumer_replicas(settings: Settings) -> int:
    """Replicas of the agent and node consumers: ``consumer_replicas``, else the streams'.

    >>> consumer_replicas(Settings(replicas=3)), consumer_replicas(Settings(replicas=3, consumer_replicas=0))
    (3, 0)
    """
    return settings.replicas if settings.consumer_replicas is None else settings.consumer_replicas


def agent_durable(agent: str, tenant: str = "*", namespace: str = "*") -> str:
    """The durable name of an agent's consumer for a tenant and namespace (``*``: any)."""
    if tenant == "*" and namespace == "*":
        return f"{agent}_consumer"
    bound = "_".join("all" if t == "*" else t for t in (tenant, namespace))
    return f"{agent}_consumer_{bound}"


def agent_consumer(
    agent: str, settings: Settings, tenant: str | None = None, namespace: str | None = None
) -> ConsumerSpec:
    """The agent's durable on MESHFORGE_COMMANDS, filtered ``cmd.<tenant|*>.<namespace|*>.<agent>.>``.

    Its name is ``<agent>_consumer`` when unbound; a worker bound to a tenant and/or a
    namespace gets its own, ``<agent>_consumer_<tenant|all>_<namespace|all>``, so workers
    of different tenants never share (or rewrite the filter of) one durable.

    MaxDeliver is unlimited on the server: the engine counts attempts itself, because a
    command held behind an earlier one of its resource is delivered again without being
    attempted (``meshforge.runtime.holds``). The delivery after the last attempt is
    dead-lettered without running, so a worker killed during its last attempt still
    yields a dead letter.

    >>> agent_consumer("order", Settings()).filter_subject
    'cmd.*.*.order.>'
    >>> agent_consumer("order", Settings(), tenant="acme").durable
    'order_consumer_acme_all'
    """
    tenant, namespace = _binding(agent, settings, tenant, namespace)
    return _command_consumer(
        agent, settings, agent_durable(agent, tenant, namespace),
        f"cmd.{tenant}.{namespace}.{agent}.>", f"MeshForge agent {agent}",
    )  # fmt: skip


def partition_consumers(
    agent: str,
    settings: Settings,
    tenant: str | None = None,
    namespace: str | None = None,
    partitions: int | None = None,
) -> dict[str, ConsumerSpec]:
    """The durables of a partitioned agent, by slot: ``p0`` ... ``p<N-1>`` and ``u``.

    Partition ``k`` is ``<durable>_p<k>`` filtered ``cmd.<t>.<ns>.<agent>.*.<k>``; slot
    ``u`` is ``<durable>_unpartitioned`` filtered ``cmd.<t>.<ns>.<agent>.*`` (five tokens,
    for publishers that do not partition). The filters are disjoint, as a work-queue
    stream requires. ``partitions`` defaults to ``settings.partitions``.

    >>> sorted(partition_consumers("order", Settings(), partitions=2))
    ['p0', 'p1', 'u']
    >>> partition_consumers("order", Settings(), partitions=2)["p1"].filter_subject
    'cmd.*.*.order.*.1'
    """
    count = settings.partitions if partitions is None else partitions
    if count < 1:
        raise TopologyError(f"agent {agent}: partitions must be >= 1 to partition, got {count}")
    tenant, namespace = _binding(agent, settings, tenant, namespace)
    base = agent_durable(agent, tenant, namespace)
    prefix = f"cmd.{tenant}.{namespace}.{agent}.*"
    durables = {f"p{k}": (f"{base}_p{k}", f"{prefix}.{k}", f"partition {k}") for k in range(count)}
    durables["u"] = (f"{base}_unpartitioned", prefix, "unpartitioned")
    ttl = pinned_ttl(settings)
    specs = {}
    for slot, (durable, subject, what) in durables.items():
        spec = _command_consumer(
            agent, settings, durable, subject, f"MeshForge agent {agent} {what}"
        )
        specs[slot] = replace(spec, priority_group=OWNER_GROUP, pinned_ttl=ttl)
    return specs


def pinned_ttl(settings: Settings) -> float:
    """How long the server keeps a partition durable pinned to a client that stopped
    pulling: a backstop only (every new owner unpins when it claims), so long enough
    that a busy owner, whose pulls wait for free capacity, does not lose its pin.

    >>> pinned_ttl(Settings())
    60.0
    """
    return max(60.0, 10 * settings.partition_lease)


def _binding(
    agent: str, settings: Settings, tenant: str | None, namespace: str | None
) -> tuple[str, str]:
    """The tenant and namespace a worker is bound to (``*``: any), validated."""
    validate_token(agent, "agent name")
    tenant = tenant or settings.tenant
    namespace = namespace or settings.namespace
    tenant = validate_token(tenant, "tenant") if tenant else "*"
    namespace = validate_token(namespace, "namespace") if namespace else "*"
    return tenant, namespace


def _command_consumer(
    agent: str, settings: Settings, durable: str, filter_subject: str, description: str
) -> ConsumerSpec:
    return ConsumerSpec(
        stream=STREAM_COMMANDS,
        durable=durable,
        filter_subject=filter_subject,
        ack_wait=settings.ack_wait,
        max_deliver=-1,  # the engine's own count (see agent_consumer)
        backoff=settings.backoff,
        description=description,
        replicas=consumer_replicas(settings),
    )


def node_consumer(site: str, node: str, settings: Settings) -> ConsumerSpec:
    """``node_<site>_<node>`` on MESHFORGE_CONTROL, filtered ``control.cmd.<site>.<node>``.

    >>> node_consumer("lab1", "node7", Settings()).durable
    'node_lab1_node7'
    """
    return ConsumerSpec(
        stream=STREAM_CONTROL,
        durable=f"node_{site}_{node}",
        filter_subject=control_command_subject(site, node),
        ack_wait=settings.ack_wait,
        # Unlimited: a command waiting for its not_before is nak'ed with a delay many
        # times; the server must not count those, so the node counts real attempts itself.
        max_deliver=-1,
        backoff=(),
        description=f"MeshForge node {site}.{node}",
        replicas=consumer_replicas(settings),
    )


# ------------------------------------------------------------------ plans and their parts


class Action(StrEnum):
    CREATE = "create"
    UPDATE = "update"
    UNCHANGED = "unchanged"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Change:
    """One field that differs: ``max_age 1d -> 2d``."""

    field: str
    current: str
    desired: str

    def __str__(self) -> str:
        return f"{self.field} {self.current} -> {self.desired}"


@dataclass(frozen=True, slots=True)
class Step:
    """What the plan does with one stream or consumer, and why."""

    kind: Literal["stream", "consumer"]
    spec: StreamSpec | ConsumerSpec
    action: Action
    changes: tuple[Change, ...] = ()
    reason: str = ""
    overlap: bool = False
    current: StreamConfig | ConsumerConfig | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def details(self) -> str:
        """The reason (refused), the diff (update), a summary (create) or nothing."""
        if self.action is Action.REFUSED:
            return self.reason
        if self.action is Action.UPDATE:
            return "; ".join(str(c) for c in self.changes)
        if self.action is Action.CREATE:
            return summarize(self.spec)
        return ""

    def __str__(self) -> str:
        return f"{self.action} {self.kind} {self.name}"


@dataclass(frozen=True, slots=True)
class Plan:
    """Every step, streams first, in the order they are applied."""

    steps: tuple[Step, ...]

    @property
    def pending(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.action in (Action.CREATE, Action.UPDATE))

    @property
    def refused(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.action is Action.REFUSED)

    @property
    def has_changes(self) -> bool:
        return bool(self.pending)


@dataclass(frozen=True, slots=True)
class ApplyReport:
    """The plan's steps and those applied; ``changed`` is False when all were unchanged."""

    steps: tuple[Step, ...]
    applied: tuple[Step, ...]

    @property
    def changed(self) -> bool:
        return bool(self.applied)


@dataclass(frozen=True, slots=True)
class Verification:
    """What ``verify`` found present, and what it could not check (with the reason)."""

    present: tuple[str, ...]
    unverified: tuple[str, ...] = ()
    reason: str = ""

    @property
    def complete(self) -> bool:
        return not self.unverified


# ------------------------------------------------------------------ formatting


def format_duration(seconds: float | None) -> str:
    """``2m``, ``1d``, ``1.5s``, ``500ms``: how plans show a duration."""
    seconds = float(seconds or 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    if seconds >= 1:
        return f"{seconds:g}s"
    return f"{seconds * 1000:g}ms"


def policy_name(x: Any) -> str:
    """A nats-py enum's wire value (or the string the server sent)."""
    return str(getattr(x, "value", x))


def describe_stream(cfg: StreamConfig) -> dict[str, str]:
    """The fields provisioning manages, as shown in plans; equal views mean no change."""
    return {
        "subjects": ", ".join(sorted(cfg.subjects or [])),
        "retention": policy_name(cfg.retention),
        "storage": policy_name(cfg.storage),
        "discard": policy_name(cfg.discard),
        "duplicate_window": format_duration(cfg.duplicate_window),
        "replicas": str(cfg.num_replicas or 1),
        "max_age": format_duration(cfg.max_age) if cfg.max_age else "unlimited",
        "max_bytes": str(cfg.max_bytes) if cfg.max_bytes and cfg.max_bytes > 0 else "unlimited",
        "allow_msg_ttl": "yes" if cfg.allow_msg_ttl else "no",
        "max_consumers": _consumers_shown(cfg.max_consumers),
    }


def _consumers_shown(max_consumers: int | None) -> str:
    if not max_consumers or max_consumers < 1:
        return f"server default ({SERVER_DEFAULT_CONSUMERS} on nats-server 2.15)"
    return "unlimited" if max_consumers >= UNLIMITED_CONSUMERS else str(max_consumers)


def describe_consumer(cfg: ConsumerConfig, stream_replicas: int | None = None) -> dict[str, str]:
    """The fields provisioning manages, as shown in plans; equal views mean no change.

    Replicas 0 means "as the stream": with ``stream_replicas`` known it shows that number,
    so a consumer that inherits 3 and one set to 3 compare equal.
    """
    filters = [cfg.filter_subject] if cfg.filter_subject else list(cfg.filter_subjects or [])
    max_deliver = cfg.max_deliver if cfg.max_deliver is not None else -1
    replicas = cfg.num_replicas or stream_replicas
    groups = getattr(cfg, "priority_groups", None)
    priority = "none"
    if groups:  # a config read by nats-py alone has none: the server's is read raw
        policy, ttl = getattr(cfg, "priority_policy", None), getattr(cfg, "priority_timeout", None)
        priority = f"{','.join(groups)} {policy or 'none'} {format_duration(ttl)}"
    return {
        "filter_subject": ", ".join(filters) or "(all)",
        "ack_wait": format_duration(cfg.ack_wait),
        "max_deliver": str(max_deliver) if max_deliver > 0 else "unlimited",
        "backoff": ",".join(format_duration(b) for b in cfg.backoff or []) or "none",
        "replicas": str(replicas) if replicas else "as stream",
        "priority_group": priority,
    }


def summarize(spec: StreamSpec | ConsumerSpec) -> str:
    """What a create makes, leaving out settings at their unlimited defaults."""
    if isinstance(spec, StreamSpec):
        view = describe_stream(spec.config())
        if view["replicas"] == "1":
            del view["replicas"]
    else:
        view = describe_consumer(spec.config())
        if view["replicas"] in ("1", "as stream"):
            del view["replicas"]
    return "; ".join(f"{k} {v}" for k, v in view.items() if v not in ("unlimited", "none"))


def diff(current: dict[str, str], desired: dict[str, str]) -> tuple[Change, ...]:
    """The fields whose shown values differ, in ``desired``'s order."""
    return tuple(Change(k, current[k], v) for k, v in desired.items() if current[k] != v)
