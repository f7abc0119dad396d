"""``AgentHarness``: run an agent's commands in-process, as the engine would, with no server.

Each ``send`` goes through the engine's own handler step (``meshforge.runtime.step``):
the typed payload decoded from the command's bytes and validated, the resource key, the
handler with its timeout, the outputs and the new state, the size check of every output
against ``limits``, and the failure decision (the engine's failure policy). A repeated
idempotency key gets the stored outputs again without running the handler; a transient
failure is tried again up to ``max_deliver`` times, then dead-lettered, as a worker would.
The handler gets the resource's state decoded from its stored bytes, as in a worker.

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

from meshforge.config import Settings
from meshforge.consume.decisions import REASON_MAX_DELIVERIES, Action, Decision
from meshforge.envelope import Envelope, Outbound, decode
from meshforge.runtime import payloads
from meshforge.runtime.agent import Agent
from meshforge.runtime.step import Step, failure_policy
from meshforge.store.base import StoredOutput
from meshforge.topology.subjects import command_subject
from meshforge.transport.sizes import SizeLimits

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
    times a transient failure is tried before the dead letter (``Settings().max_deliver``);
    ``handler_timeout`` bounds an ``async def`` handler without a timeout of its own
    (``Settings().handler_timeout``); ``limits`` are the server's message limits (its
    default ``max_payload``).
    """

    def __init__(
        self, agent: Agent[S], *, tenant: str = "default", namespace: str = "test",
        max_deliver: int = 5, handler_timeout: float | None = None,
        limits: SizeLimits | None = None,
    ) -> None:  # fmt: skip
        self.agent = agent
        self.tenant = tenant
        self.namespace = namespace
        self.max_deliver = max_deliver
        self.limits = limits or SizeLimits()
        self.step = Step(
            agent, failure_policy(agent, max_deliver, ()),
            handler_timeout=handler_timeout or Settings().handler_timeout,
        )  # fmt: skip
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
        """Handle one command now; ``payload`` is a dict or a typed payload (sent as its
        fields, as a publisher would); ``fields`` go to ``Envelope.new`` (e.g.
        ``idempotency_key``).

        Usable from plain and from ``async`` tests (then it runs on a helper thread).
        """
        return _run_sync(self.asend(command, payload, envelope=envelope, **fields))

    async def asend(
        self, command: str, payload: Mapping[str, Any] | Any = None, *,
        envelope: Envelope | None = None, **fields: Any,
    ) -> Sent[S]:  # fmt: skip
        """``send`` for ``async`` tests."""
        agent, step = self.agent, self.step
        env = envelope or Envelope.new(
            f"{agent.name}.{command}", payloads.to_builtins(payload or {}), tenant_id=self.tenant,
            source="test", **fields,
        )  # fmt: skip
        subject = command_subject(self.tenant, self.namespace, agent.name, command)
        body = Outbound.of(subject, env).data  # the command as a worker receives it
        spec = step.commands.get(command)
        stored = self._effects.get(env.key)
        if stored is not None:
            resource = self._resource_quietly(env, body, command)
            sent: Sent[S] = Sent(env, subject, resource, _messages(stored), duplicate=True)
            sent.state = self.state(resource) if resource is not None else None
            return sent
        if spec is None:
            return self._dead(Sent(env, subject, None), step.unknown(env))
        attempt = 0
        while True:
            attempt += 1
            try:
                cmd, resource = step.prepare(spec, env, body)
                new_state, messages, _events = await step.run(
                    spec, cmd, resource, subject, self._load(resource), self.limits
                )
            except Exception as exc:
                decision = step.decide(exc, attempt)
                if decision.action is Action.NAK:
                    continue  # a worker would deliver it again after the backoff
                resource_ = self._resource_quietly(env, body, command)
                return self._dead(Sent(env, subject, resource_, deliveries=attempt), decision)
            break
        self.states[resource] = new_state
        self._effects[env.key] = messages
        decoded = _messages(messages)
        self.published.extend(decoded)
        self.events.extend(e for s, e in decoded if s.startswith("evt."))
        return Sent(env, subject, resource, decoded, new_state, deliveries=attempt)

    def _load(self, resource: str) -> S:
        """The resource's state as a worker reads it: decoded from its stored bytes (a
        handler that changes it in place and then fails changes nothing)."""
        if resource not in self.states:
            return self.agent.initial()
        return self.agent.decode_state(self.agent.encode_state(self.states[resource]))

    def _resource_quietly(self, env: Envelope, body: bytes, command: str) -> str | None:
        spec = self.step.commands.get(command)
        try:
            return self.step.prepare(spec, env, body)[1] if spec else None
        except Exception:  # the payload or the key itself is what failed
            return None

    def _dead(self, sent: Sent[S], decision: Decision) -> Sent[S]:
        reason = decision.reason or REASON_MAX_DELIVERIES
        error = decision.error or f"dead-lettered as {reason}"
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
