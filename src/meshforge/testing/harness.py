"""``AgentHarness``: run an agent's commands in-process, as the engine would, with no server.

Each ``send`` goes through the engine's own steps: the resource key (``Agent.resource_key``),
the handler (``Agent.handle``), the outputs and the new state (``build_outputs``), and the
failure decision (the engine's failure policy, ``failure_policy``). A repeated
idempotency key gets the stored outputs again without running the handler; a transient
failure is tried again up to ``max_deliver`` times, then dead-lettered, as a worker would.

Example::

    harness = AgentHarness(OrderAgent())
    result = harness.send("create", {"sku": "A-1", "qty": 2})
    assert result.event_types == ["order.created"]
    assert harness.state(result.resource).status == "created"
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from meshforge.consume.decisions import REASON_MAX_DELIVERIES, REASON_UNRECOVERABLE, Action
from meshforge.consume.policy import Cause, Outcome
from meshforge.envelope import Envelope, decode
from meshforge.errors import one_line
from meshforge.runtime import payloads
from meshforge.runtime.agent import Agent, Command
from meshforge.runtime.engine import failure_policy
from meshforge.runtime.outputs import build_outputs
from meshforge.store.base import StoredOutput
from meshforge.topology.subjects import command_subject

__all__ = ["AgentHarness", "HarnessDeadLetter", "Sent"]

S = TypeVar("S")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HarnessDeadLetter:
    """A command the agent could not handle: where it went and why."""

    subject: str
    command: Envelope
    reason: str
    error: str
    deliveries: int


@dataclass(slots=True)
class Sent(Generic[S]):
    """What one ``send`` did: the command, its outputs, the resource's state after it."""

    command: Envelope
    subject: str
    resource: str | None
    messages: list[tuple[str, Envelope]] = field(default_factory=list)
    state: S | None = None
    dead_letter: HarnessDeadLetter | None = None
    duplicate: bool = False
    deliveries: int = 1

    @property
    def events(self) -> list[Envelope]:
        """The events published, in order."""
        return [env for subject, env in self.messages if subject.startswith("evt.")]

    @property
    def commands(self) -> list[tuple[str, Envelope]]:
        """The commands sent to other agents, as ``(subject, envelope)``."""
        return [(s, env) for s, env in self.messages if s.startswith("cmd.")]

    @property
    def event_types(self) -> list[str]:
        """``["order.created", ...]``: the events' types, in order."""
        return [env.type for env in self.events]

    def event(self, type_: str) -> Envelope:
        """The one event of type ``type_`` (``order.created`` or just ``created``)."""
        found = [e for e in self.events if e.type == type_ or e.type.endswith("." + type_)]
        if len(found) != 1:
            raise AssertionError(f"expected one {type_!r} event, got types {self.event_types}")
        return found[0]


class AgentHarness(Generic[S]):
    """One agent, its states, event log and dead letters, all in memory.

    ``tenant`` and ``namespace`` make the command subjects; ``max_deliver`` is how many
    times a transient failure is tried before the dead letter (``Settings().max_deliver``).
    """

    def __init__(
        self, agent: Agent[S], *, tenant: str = "default", namespace: str = "test",
        max_deliver: int = 5,
    ) -> None:  # fmt: skip
        self.agent = agent
        self.tenant = tenant
        self.namespace = namespace
        self.max_deliver = max_deliver
        self.states: dict[str, S] = {}
        self.events: list[Envelope] = []
        self.published: list[tuple[str, Envelope]] = []
        self.dead_letters: list[HarnessDeadLetter] = []
        self._effects: dict[str, list[StoredOutput]] = {}

    def state(self, resource: str) -> S:
        """The state of ``resource`` (the initial state when it has no events)."""
        return self.states.get(resource, self.agent.initial())

    def send(
        self, command: str, payload: Mapping[str, Any] | Any = None, *,
        envelope: Envelope | None = None, **fields: Any,
    ) -> Sent[S]:  # fmt: skip
        """Handle one command now; ``fields`` go to ``Envelope.new`` (e.g. ``idempotency_key``).

        Usable from plain and from ``async`` tests (then it runs on a helper thread).
        """
        return _run_sync(self.asend(command, payload, envelope=envelope, **fields))

    async def asend(
        self, command: str, payload: Mapping[str, Any] | Any = None, *,
        envelope: Envelope | None = None, **fields: Any,
    ) -> Sent[S]:  # fmt: skip
        """``send`` for ``async`` tests."""
        agent = self.agent
        env = envelope or Envelope.new(
            f"{agent.name}.{command}", payloads.to_builtins(payload or {}), tenant_id=self.tenant,
            source="test", **fields,
        )  # fmt: skip
        subject = command_subject(self.tenant, self.namespace, agent.name, command)
        stored = self._effects.get(env.key)
        if stored is not None:
            resource = self._resource_quietly(env, command)
            sent: Sent[S] = Sent(env, subject, resource, _messages(stored), duplicate=True)
            sent.state = self.state(resource) if resource is not None else None
            return sent
        spec = agent.commands().get(command)
        if spec is None:
            known = ", ".join(sorted(agent.commands())) or "none"
            error = f"unknown command {env.type!r} for agent {agent.name!r} (known: {known})"
            return self._dead(Sent(env, subject, None), REASON_UNRECOVERABLE, error)
        attempt = 0
        while True:
            attempt += 1
            try:
                cmd = env
                if spec.payload is not None:
                    cmd = Command.of(env, payloads.decoder(spec.payload).decode_body(env.encode()))
                resource = agent.resource_key(cmd, spec)
                state = self.state(resource)
                outputs = await agent.handle(spec, cmd, state)
                new_state, messages, _events = build_outputs(
                    agent, env, resource, subject, outputs, state
                )
            except Exception as exc:
                policy = failure_policy(agent, self.max_deliver, ())
                decision = policy.decide(Outcome(Cause.HANDLER, attempt, exc))
                if decision.action is Action.NAK:
                    continue  # a worker would deliver it again after the backoff
                sent = Sent(env, subject, self._resource_quietly(env, command), deliveries=attempt)
                return self._dead(
                    sent, decision.reason or REASON_MAX_DELIVERIES, decision.error or one_line(exc)
                )
            break
        self.states[resource] = new_state
        self._effects[env.key] = messages
        decoded = _messages(messages)
        self.published.extend(decoded)
        self.events.extend(e for s, e in decoded if s.startswith("evt."))
        return Sent(env, subject, resource, decoded, new_state, deliveries=attempt)

    def _resource_quietly(self, env: Envelope, command: str) -> str | None:
        spec = self.agent.commands().get(command)
        try:
            if spec is not None and spec.payload is not None:
                env = Command.of(env, payloads.decoder(spec.payload).decode_body(env.encode()))
            return self.agent.resource_key(env, spec) if spec else None
        except Exception:  # the key itself is what failed
            return None

    def _dead(self, sent: Sent[S], reason: str, error: str) -> Sent[S]:
        letter = HarnessDeadLetter(
            f"failed.{sent.subject}", sent.command, reason, error, sent.deliveries
        )
        self.dead_letters.append(letter)
        sent.dead_letter = letter
        if sent.resource is not None:
            sent.state = self.state(sent.resource)
        return sent


def _messages(stored: list[StoredOutput]) -> list[tuple[str, Envelope]]:
    return [(o.subject, decode(o.data, o.headers)) for o in stored]


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from sync code, even when an event loop runs here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
