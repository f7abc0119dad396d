"""The store's contract: the records it keeps and the ``Store`` / ``Transaction`` protocols.

Everything a command changes (state, events, outputs, the idempotency key, outbox rows,
the user's own tables) is written through one ``Transaction`` so it commits or vanishes
together. What an agent keeps is scoped: states, events, effects and inbox rows take a
``scope`` (tenant and namespace, ``meshforge.topology.scope.Scope``; the default scope when
omitted), so two tenants may use one resource id or one idempotency key apart. The API is synchronous and thread-safe; async code calls it through
``asyncio.to_thread``.

Example::

    store = open_store("sqlite:///.meshforge/store.db")
    with store.transaction() as tx:
        if tx.effect_get("order_consumer", key) is None:
            tx.state_put("order", order_id, state, position=1)
            tx.effect_put("order_consumer", key, command_id, outputs)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import MISSING, dataclass, field, fields
from datetime import datetime
from typing import Any, Literal, Protocol, TypeVar

from meshforge.topology.scope import DEFAULT_SCOPE, Scope

T = TypeVar("T")
C = TypeVar("C", bound=type)


class _Omitted:
    """An argument left to its field's ``default_factory`` (shown as dataclasses show it)."""

    def __repr__(self) -> str:
        return "<factory>"


_OMITTED = _Omitted()


def quick_init(cls: C) -> C:
    """Give a frozen, slotted dataclass an ``__init__`` that fills its slots through their
    own descriptors. A frozen dataclass's generated one calls ``object.__setattr__`` once a
    field, two to three times slower, and the engine makes several of these records for
    every command. Same parameters, defaults and errors; still a dataclass in every other
    way (``fields``, ``replace``, ``asdict``, equality, hashing, immutability)."""
    params: list[str] = []
    lines: list[str] = []
    names: dict[str, Any] = {"_OMITTED": _OMITTED}
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: quick_init does not call __post_init__")
    for f in fields(cls):
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__name__}.{f.name}: quick_init takes plain positional fields")
        names[f"_set_{f.name}"] = getattr(cls, f.name).__set__  # the slot's member descriptor
        value = f.name
        if f.default is not MISSING:
            names[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not MISSING:
            names[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_OMITTED")
            value = f"_factory_{f.name}() if {f.name} is _OMITTED else {f.name}"
        else:
            params.append(f.name)
        lines.append(f"    _set_{f.name}(self, {value})")
    source = f"def __init__(self, {', '.join(params)}):\n" + "\n".join(lines or ["    pass"])
    exec(source, names)  # as dataclasses itself makes __init__
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__annotations__ = dict(vars(cls)["__init__"].__annotations__)  # the generated one's
    setattr(cls, "__init__", init)  # noqa: B010  (a class, not an instance)
    return cls


InboxStatus = Literal["received", "processing", "processed", "failed"]
OutboxState = Literal["pending", "publishing", "sent", "failed"]
DialectName = Literal["sqlite", "postgresql"]


@quick_init
@dataclass(frozen=True, slots=True)
class StoredOutput:
    """One message a command produced, kept with its effect so it can be re-published as is."""

    position: int
    subject: str
    msg_id: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EffectRecord:
    """A processed idempotency key with the outputs it produced, in position order."""

    consumer: str
    key: str
    command_id: str
    outputs: tuple[StoredOutput, ...]
    created_at: datetime
    published_at: datetime | None
    scope: Scope = DEFAULT_SCOPE


@dataclass(frozen=True, slots=True)
class InboxRecord:
    """A received message per consumer; ``status`` says whether it was already processed."""

    key: str
    consumer: str
    message_id: str | None
    type: str | None
    subject: str | None
    stream: str | None
    stream_seq: int | None
    status: InboxStatus
    attempts: int
    deliveries: int
    error: str | None
    resource_type: str | None
    resource_id: str | None
    headers: dict[str, str]
    received_at: datetime
    processed_at: datetime | None
    failed_at: datetime | None
    created_at: datetime
    updated_at: datetime
    scope: Scope = DEFAULT_SCOPE

    @property
    def processed(self) -> bool:
        """True when an earlier delivery finished this message."""
        return self.status == "processed"


@quick_init
@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to append to an agent's log."""

    event_id: str
    type: str
    resource_id: str | None
    command_id: str
    key: str
    data: bytes
    ts: str


@quick_init
@dataclass(frozen=True, slots=True)
class StoredEvent(NewEvent):
    """An appended event: its agent, gapless ``position`` in the log of (scope, agent), when
    it was stored, and its scope."""

    agent: str
    position: int
    stored_at: datetime
    scope: Scope = DEFAULT_SCOPE


@quick_init
@dataclass(frozen=True, slots=True)
class NewState:
    """A resource's state snapshot to store, as of event ``position`` of its log."""

    resource_id: str
    data: bytes
    position: int
    scope: Scope = DEFAULT_SCOPE


@quick_init
@dataclass(frozen=True, slots=True)
class NewEffect:
    """A processed idempotency key to store with the outputs its command produced."""

    key: str
    command_id: str
    outputs: Sequence[StoredOutput]
    scope: Scope = DEFAULT_SCOPE


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    """A message to queue in the outbox (``Transaction.outbox_add_many``)."""

    msg_id: str
    subject: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)


#: A resource id or an idempotency key with its scope: how the batch methods name rows.
Scoped = tuple[Scope, str]


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """A message waiting in the outbox (or claimed by a relay)."""

    id: int
    msg_id: str
    subject: str
    data: bytes
    headers: dict[str, str]
    attempts: int
    state: OutboxState
    created_at: datetime


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A control-plane node's boot counter."""

    site: str
    node: str
    epoch: int
    updated_at: datetime


class Transaction(Protocol):
    """One database transaction. Not shared between threads.

    After any ``StoreError`` raised inside it the transaction is spoiled: it will roll
    back when the ``with`` block ends, whatever the block does.
    """

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run the user's own SQL (``?`` placeholders on every backend); returns the rows.

        Example: ``tx.execute("UPDATE stock SET qty = qty - ? WHERE sku = ?", (2, "A1"))``
        """
        ...

    def inbox_begin(
        self,
        key: str,
        consumer: str,
        *,
        message_id: str | None,
        type: str | None,
        subject: str | None,
        stream: str | None,
        stream_seq: int | None,
        deliveries: int,
        headers: dict[str, str],
        resource_type: str | None = None,
        resource_id: str | None = None,
        scope: Scope = DEFAULT_SCOPE,
    ) -> InboxRecord:
        """Find or insert the (scope, key, consumer) row, locked; unless processed, mark it
        ``processing`` and count the attempt. ``record.processed`` means: skip and ack."""
        ...

    def inbox_done(self, key: str, consumer: str, *, scope: Scope = DEFAULT_SCOPE) -> None:
        """Mark the message processed."""
        ...

    def inbox_failed(
        self, key: str, consumer: str, error: str, *, scope: Scope = DEFAULT_SCOPE
    ) -> None:
        """Mark the message failed with a one-line error."""
        ...

    def effect_get(
        self, consumer: str, key: str, *, scope: Scope = DEFAULT_SCOPE
    ) -> list[StoredOutput] | None:
        """The outputs stored for this key in this scope, or None when it was never processed."""
        ...

    def effect_put(
        self,
        consumer: str,
        key: str,
        command_id: str,
        outputs: Sequence[StoredOutput],
        *,
        scope: Scope = DEFAULT_SCOPE,
    ) -> None:
        """Record the key as processed with its outputs; a second put raises
        ``StoreError(kind="duplicate")`` because it would double the effect."""
        ...

    def effect_mark_published(
        self, consumer: str, key: str, *, scope: Scope = DEFAULT_SCOPE
    ) -> None:
        """Note that the outputs of this key reached the broker."""
        ...

    def events_append(
        self, agent: str, events: Sequence[NewEvent], *, scope: Scope = DEFAULT_SCOPE
    ) -> list[int]:
        """Append events to the log of (scope, agent); returns their positions (gapless from 1).

        The log's head row stays locked until the transaction ends, and every writer of the
        log waits for it: append as late as you can, just before the commit."""
        ...

    def state_get(
        self, agent: str, resource_id: str, *, scope: Scope = DEFAULT_SCOPE
    ) -> bytes | None:
        """The resource's state snapshot, locked until the transaction ends."""
        ...

    def state_put(
        self,
        agent: str,
        resource_id: str,
        data: bytes,
        position: int,
        *,
        scope: Scope = DEFAULT_SCOPE,
    ) -> None:
        """Store the resource's state snapshot as of event ``position``."""
        ...

    # Batch forms: one statement for many rows (two for ``states_get`` on PostgreSQL),
    # where the single-row methods above cost one round trip each. A batch of commands:
    #
    #     states = tx.states_get("order", [(scope, "o-1"), (scope, "o-2")])
    #     done = tx.effects_get("order_consumer", [(scope, "k-1"), (scope, "k-2")])
    #     ...                                     # run the commands whose done[...] is None
    #     tx.effects_put("order_consumer", [NewEffect("k-1", "c-1", outputs, scope)])
    #     positions = tx.events_append("order", events, scope=scope)
    #     tx.states_put("order", [NewState("o-1", data, positions[-1], scope)])

    def states_get(self, agent: str, resources: Iterable[Scoped]) -> dict[Scoped, bytes | None]:
        """Lock and read the snapshots of many resources; an entry for every one asked,
        None where none is stored yet. Locks are taken in one fixed order, so transactions
        asking for overlapping sets take turns instead of deadlocking."""
        ...

    def states_put(self, agent: str, states: Sequence[NewState]) -> None:
        """Store many snapshots at once; of one resource given twice the last one stays."""
        ...

    def effects_get(
        self, consumer: str, keys: Iterable[Scoped]
    ) -> dict[Scoped, list[StoredOutput] | None]:
        """The outputs stored for each key (as ``effect_get``): an entry for every key asked."""
        ...

    def effects_put(self, consumer: str, effects: Sequence[NewEffect]) -> None:
        """Record many keys as processed with their outputs. When any key is already stored
        (or given twice) raise ``StoreError(kind="duplicate")`` naming it, and store none."""
        ...

    def effects_mark_published(self, consumer: str, keys: Iterable[Scoped]) -> int:
        """Note that the outputs of these keys reached the broker; returns how many effects
        were marked (a key whose effect retention already deleted is passed over). An
        effect marked again keeps the time of its first mark as its ``published_at``."""
        ...

    def outbox_add(self, *, msg_id: str, subject: str, data: bytes, headers: dict[str, str]) -> int:
        """Queue a message for the relay; returns its row id."""
        ...

    def outbox_add_many(self, messages: Sequence[OutboxMessage]) -> list[int]:
        """Queue many messages in one statement; returns their row ids, in order.

        Example: ``tx.outbox_add_many([OutboxMessage("m-1", "evt.default.demo.a.b", b"{}", {})])``
        """
        ...

    def node_epoch_bump(self, site: str, node: str) -> int:
        """Count one more boot of the node: 1 on the first, one higher each call."""
        ...

    def node_epoch(self, site: str, node: str) -> int | None:
        """The node's current boot counter, None if it never started."""
        ...

    def node_reply_get(self, site: str, node: str, command_id: str) -> bytes | None:
        """The reply stored for a control command, None if it never ran."""
        ...

    def node_reply_put(self, site: str, node: str, command_id: str, reply: bytes) -> None:
        """Store a control command's reply; a second put raises ``StoreError(kind="duplicate")``."""
        ...


class Store(Protocol):
    """The persistent store: one interface over SQLite and PostgreSQL."""

    @property
    def url(self) -> str:
        """The URL the store was opened with."""
        ...

    @property
    def dialect(self) -> DialectName:
        """``sqlite`` or ``postgresql``."""
        ...

    def transaction(self) -> AbstractContextManager[Transaction]:
        """One transaction: commit on success, roll back on exception.

        It may be entered and left on different threads (``asyncio.to_thread``), but is
        used by one caller at a time. Do not call the store-level methods below, or open
        another transaction, from inside it: on SQLite that waits for ``busy_timeout`` and
        then raises ``StoreError(kind="busy")``.
        """
        ...

    def transaction_now(
        self,
    ) -> tuple[AbstractContextManager[Transaction], Transaction] | None:
        """A transaction begun without waiting, as ``(cm, tx)`` (``cm`` entered: leave it
        to commit or roll back), or None where beginning one would wait: another
        transaction holds the store, or the store is across a network (PostgreSQL: always
        None). For a caller that runs a short transaction on its event loop."""
        ...

    def run(self, work: Callable[[Transaction], T], *, attempts: int = 5) -> T:
        """Run ``work(tx)`` in a transaction, again while it fails with a retriable error."""
        ...

    def close(self) -> None:
        """Release connections; further use raises ``StoreError(kind="closed")``."""
        ...

    def __enter__(self) -> Store:
        """``with open_store(url) as store:`` closes the store on the way out."""
        ...

    def __exit__(self, *exc: object) -> None: ...

    def outbox_claim(
        self,
        relay_id: str,
        limit: int,
        lease_seconds: float,
        *,
        mark_sent: Sequence[int] = (),
    ) -> list[OutboxRow]:
        """Lease up to ``limit`` due rows (pending, expired lease, or failed and due) by id;
        in the same transaction mark the rows ``mark_sent`` sent (a relay's last batch).

        Example: ``rows = store.outbox_claim("relay-1", 500, 30.0, mark_sent=[r.id for r in sent])``
        """
        ...

    def outbox_mark_sent(self, ids: Sequence[int]) -> None:
        """Mark rows sent."""
        ...

    def outbox_mark_failed(
        self, id: int, error: str, retry_at: datetime, *, give_up: bool = False
    ) -> None:
        """Count a failed attempt; retry after ``retry_at``, or never when ``give_up``."""
        ...

    def outbox_depth(self) -> int:
        """Rows still to publish: pending, publishing, and failed but not given up."""
        ...

    def outbox_cleanup(self, older_than: datetime) -> int:
        """Delete rows sent before ``older_than``; returns how many."""
        ...

    def inbox_cleanup(self, older_than: datetime) -> int:
        """Delete processed or failed inbox rows last touched before ``older_than``."""
        ...

    def effects_cleanup(self, older_than: datetime) -> int:
        """Delete effects (and their outputs) stored before ``older_than``; events stay."""
        ...

    def node_replies_cleanup(self, older_than: datetime) -> int:
        """Delete control-plane node replies stored before ``older_than``."""
        ...

    def events_read(
        self,
        agent: str,
        after: int = 0,
        limit: int | None = None,
        *,
        scope: Scope = DEFAULT_SCOPE,
    ) -> Iterator[StoredEvent]:
        """The events of (scope, agent) after position ``after``, in order, page by page."""
        ...

    def agents(self) -> list[str]:
        """Agents that have appended events (in any scope), sorted."""
        ...

    def logs(self, agent: str | None = None) -> list[tuple[Scope, str]]:
        """Every (scope, agent) event log (of one agent), sorted."""
        ...

    def effects_read(self, consumer: str | None = None) -> Iterator[EffectRecord]:
        """Every stored effect (of one consumer) in the order they were stored, page by page;
        ``published_at`` is the time of the first mark of its key."""
        ...

    def inbox_read(
        self, consumer: str | None = None, *, status: InboxStatus | None = None
    ) -> Iterator[InboxRecord]:
        """Inbox rows (of one consumer, of one status), by (scope, consumer, key), page by page."""
        ...

    def nodes(self) -> list[NodeInfo]:
        """Every known control-plane node with its epoch."""
        ...
