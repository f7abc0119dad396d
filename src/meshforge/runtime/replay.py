"""Rebuild an agent's state from its event log, and the state hash that proves it.

The state hash is SHA-256 over a canonical encoding of the agent's events: each event
is the sorted-keys JSON of ``[event_id, type, resource_id, data]``; a resource's events
are hashed in log order, then the per-resource digests in resource order. Each (tenant,
namespace) has its own log. Replaying one log (or an agent that has only one) names
resources by their id, exactly as before logs were scoped; replaying several names each
resource outside the default scope ``tenant/namespace/id`` (in the hash and in
``states``), so two tenants' ``o-1`` are two resources. So the hash
depends only on what happened to each resource and in which order, never on how
commands of different resources interleaved, how often they were delivered, where
workers crashed or how batches were cut.

Given the agent, the states are rebuilt too, and ``snapshot_hash`` (over the rebuilt
states) is compared with ``stored_hash`` (the same over the snapshots the store holds).

Example::

    result = replay(store, "order", OrderAgent())                  # every tenant's log
    one = replay(store, "order", OrderAgent(), scope=Scope("acme", "shop"))
    print(result.events, result.state_hash, result.mismatched)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from meshforge.runtime.agent import Agent
from meshforge.runtime.outputs import stored_event
from meshforge.store.base import Store, StoredEvent
from meshforge.topology.scope import DEFAULT_SCOPE, Scope

__all__ = ["ReplayResult", "StateHasher", "canonical", "label", "replay", "state_hash"]

_CANONICAL = msgspec.json.Encoder(order="sorted")
_DECODER = msgspec.json.Decoder()
_SNAPSHOT_CHUNK = 500  # resources read per transaction (each read takes a row lock)


def canonical(data: bytes) -> Any:
    """JSON bytes as a value, for canonical re-encoding (bytes that are not JSON as hex)."""
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError:
        return {"$hex": bytes(data).hex()}


def label(scope: Scope, resource: str, *, named: bool = True) -> str:
    """How a resource is shown: ``tenant/namespace/id`` when ``named`` and outside the
    default scope, else its id."""
    if not named or scope == DEFAULT_SCOPE:
        return resource
    return f"{scope.tenant}/{scope.namespace}/{resource}"


class StateHasher:
    """Accumulates events (each resource's in log order) into the state hash; ``named``
    keys resources by their scope too (for several logs at once)."""

    def __init__(self, *, named: bool = False) -> None:
        self._per_resource: dict[tuple[str, ...], Any] = {}
        self._named = named
        self.events = 0

    def add(self, event: StoredEvent) -> None:
        scope, resource_id = event.scope, event.resource_id or ""
        named = self._named and scope != DEFAULT_SCOPE
        resource = (scope.tenant, scope.namespace, resource_id) if named else (resource_id,)
        digest = self._per_resource.get(resource)
        if digest is None:
            digest = self._per_resource[resource] = hashlib.sha256()
        record = [event.event_id, event.type, event.resource_id, canonical(event.data)]
        digest.update(_CANONICAL.encode(record) + b"\n")
        self.events += 1

    @property
    def resources(self) -> int:
        return len(self._per_resource)

    def hexdigest(self) -> str:
        total = hashlib.sha256()
        for resource in sorted(self._per_resource):
            record = [*resource, self._per_resource[resource].hexdigest()]
            total.update(_CANONICAL.encode(record) + b"\n")
        return total.hexdigest()


def state_hash(events: Iterable[StoredEvent], *, named: bool = False) -> str:
    """The state hash of events given in log order (see ``StateHasher`` for ``named``)."""
    hasher = StateHasher(named=named)
    for event in events:
        hasher.add(event)
    return hasher.hexdigest()


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What a replay found: counts, the state hash, and (with an agent) the rebuilt states."""

    agent: str
    events: int
    resources: int
    state_hash: str
    states: dict[str, Any] = field(default_factory=dict)
    snapshot_hash: str | None = None  # over the states rebuilt from the events
    stored_hash: str | None = None  # over the snapshots the store held (same resources)
    mismatched: tuple[str, ...] = ()

    @property
    def consistent(self) -> bool:
        """Every stored snapshot equals the state rebuilt from the events."""
        return not self.mismatched


def _snapshot_digest(states: dict[str, bytes]) -> str:
    total = hashlib.sha256()
    for resource in sorted(states):
        total.update(_CANONICAL.encode([resource, canonical(states[resource])]) + b"\n")
    return total.hexdigest()


def replay(
    store: Store, agent_name: str, agent: Agent[Any] | None = None, *, scope: Scope | None = None
) -> ReplayResult:
    """Read the agent's events in order (of one scope, or of every scope's log); hash them
    and, given the agent, fold them into states and compare each with the snapshot the
    store holds (blocking; use a thread). States are keyed by ``label(scope, resource)``."""
    scopes = [scope] if scope is not None else [s for s, _ in store.logs(agent_name)]
    named = len(scopes) > 1
    hasher = StateHasher(named=named)
    states: dict[str, Any] = {}
    where: dict[str, tuple[Scope, str]] = {}
    for log_scope in scopes:
        for event in store.events_read(agent_name, scope=log_scope):
            hasher.add(event)
            if agent is not None:
                resource = event.resource_id or ""
                key = label(log_scope, resource, named=named)
                where[key] = (log_scope, resource)
                state = states[key] if key in states else agent.initial()
                states[key] = agent.apply(state, stored_event(agent, event.type, event.data))
    if agent is None:
        return ReplayResult(agent_name, hasher.events, hasher.resources, hasher.hexdigest())
    rebuilt = {key: agent.encode_state(state) for key, state in states.items()}
    stored = _snapshots(store, agent_name, {k: where[k] for k in sorted(rebuilt)})
    mismatched = tuple(
        r for r in sorted(rebuilt)
        if stored.get(r) is None or canonical(stored[r]) != canonical(rebuilt[r])
    )  # fmt: skip
    return ReplayResult(
        agent=agent_name,
        events=hasher.events,
        resources=hasher.resources,
        state_hash=hasher.hexdigest(),
        states=states,
        snapshot_hash=_snapshot_digest(rebuilt),
        stored_hash=_snapshot_digest(stored),
        mismatched=mismatched,
    )


def _snapshots(
    store: Store, agent_name: str, resources: dict[str, tuple[Scope, str]]
) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    keys = list(resources)
    for start in range(0, len(keys), _SNAPSHOT_CHUNK):
        with store.transaction() as tx:
            for key in keys[start : start + _SNAPSHOT_CHUNK]:
                scope, resource = resources[key]
                data = tx.state_get(agent_name, resource, scope=scope)
                if data is not None:
                    found[key] = data
    return found
