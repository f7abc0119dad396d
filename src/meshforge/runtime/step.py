"""The handler step: what one delivered command becomes, its outputs or its failure's decision.

Both the effect engine (``runtime/engine.py``, inside its store transaction) and the
in-process ``AgentHarness`` (``testing/harness.py``) run a command through this one
step, so a test that passes in the harness passes in a worker:

1. ``prepare``: decode and validate a typed command's payload (once, from the body, into
   its declared type: a ``Command``) and find the resource key;
2. ``run``: the handler, bounded by its timeout (an ``async def`` handler's: the
   command's, else the agent's, else ``handler_timeout``), then the outputs and the new
   state (``build_outputs``), then the size check of every output (one the server would
   refuse makes the command unrecoverable before its effect is stored);
3. ``decide``: what a failure of either becomes (the agent's failure policy,
   ``failure_policy``: the errors that can never succeed, the agent's own among them).

What the step leaves to its callers: where the state comes from and where the outputs
go (the engine: a store transaction, grouping, holds and retries; the harness: memory).

Example::

    step = Step(agent, failure_policy(agent, 5, ()), handler_timeout=300.0)
    try:
        cmd, resource = step.prepare(spec, env, body)
        state, outputs, events = await step.run(spec, cmd, resource, subject, state, limits)
    except Exception as exc:
        decision = step.decide(exc, attempt)
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Generic, TypeVar

from meshforge.consume.decisions import REASON_UNRECOVERABLE, Decision
from meshforge.consume.policy import Cause, FailurePolicy, Outcome
from meshforge.envelope import H_MSG_ID, Envelope
from meshforge.errors import HandlerTimeout, InvalidSubject, PublishError, Unrecoverable
from meshforge.runtime import payloads
from meshforge.runtime.agent import Agent, Command, CommandSpec, Output
from meshforge.runtime.outputs import build_outputs
from meshforge.store.base import NewEvent, StoredOutput
from meshforge.topology.scope import Scope
from meshforge.transport.sizes import SizeLimits, check_fits

__all__ = ["Ran", "Step", "check_sizes", "failure_policy"]

S = TypeVar("S")
#: What ``Step.run`` gives: the new state, the messages to store and publish, the events.
Ran = tuple[S, list[StoredOutput], list[NewEvent]]
# Errors that say "this command can never succeed": dead letter, never retry.
_UNRECOVERABLE: tuple[type[BaseException], ...] = (
    Unrecoverable, ValueError, KeyError, TypeError, IndexError, InvalidSubject,
)  # fmt: skip


def failure_policy(
    agent: Agent[Any], max_deliver: int, backoff: tuple[float, ...]
) -> FailurePolicy:
    """An agent's failure policy: the engine's unrecoverable errors and the agent's own,
    and a stop behind each dead letter if the agent asks for it."""
    return FailurePolicy(
        max_deliver=max_deliver, backoff=backoff, unrecoverable=_UNRECOVERABLE + agent.unrecoverable,
        stop_after_dead_letter=agent.hold_after_dead_letter,
    )  # fmt: skip


class Step(Generic[S]):
    """One agent's handler step (see the module docstring). ``partitions`` is the
    deployment's partition count (a ``Send`` goes to its partition's subject)."""

    def __init__(
        self, agent: Agent[S], policy: FailurePolicy, *, handler_timeout: float,
        partitions: int = 0,
    ) -> None:  # fmt: skip
        self.agent = agent
        self.policy = policy
        self.handler_timeout = handler_timeout
        self.partitions = partitions
        self.commands = agent.commands()
        # Plain-function handlers behind the stock Agent.handle never await anything: they
        # need no timer (a timer could not interrupt them), and the engine may run them
        # with no event loop at all.
        stock = type(agent).handle is Agent.handle
        self.sync_commands = frozenset(
            name for name, spec in self.commands.items()
            if stock and not inspect.iscoroutinefunction(spec.handler)
        )  # fmt: skip
        self._decoders = {
            name: payloads.decoder(spec.payload)
            for name, spec in self.commands.items()
            if spec.payload is not None
        }

    def unknown(self, env: Envelope) -> Decision:
        """The decision for a command this agent does not declare."""
        known = ", ".join(sorted(self.commands)) or "none"
        return self.policy.decide(Outcome(
            Cause.REFUSED, reason=REASON_UNRECOVERABLE,
            error=f"unknown command {env.type!r} for agent {self.agent.name!r} (known: {known})",
        ))  # fmt: skip

    def prepare(self, spec: CommandSpec, env: Envelope, body: bytes) -> tuple[Envelope, str]:
        """The command as its handler takes it and its resource key. A typed command's
        payload is decoded from ``body`` (the envelope's bytes) into its declared type;
        one that does not fit raises ``InvalidPayload``, a bad key ``Unrecoverable``."""
        if spec.payload is not None:
            env = Command.of(env, self._decoders[spec.name].decode_body(body))
        return env, self.agent.resource_key(env, spec)

    async def run(
        self, spec: CommandSpec, cmd: Envelope, resource: str, subject: str, state: S,
        limits: SizeLimits, scope: Scope | None = None,
    ) -> Ran[S]:  # fmt: skip
        """The handler over ``state``, bounded by its timeout, then its outputs (built as
        children of ``cmd``, size-checked) and the new state. ``state`` may be changed in
        place by a handler that then fails: the caller keeps its own copy."""
        agent = self.agent
        outputs: list[Output]
        if spec.name in self.sync_commands:
            outputs = await agent.handle(spec, cmd, state)
        else:
            limit = spec.timeout or agent.timeout or self.handler_timeout
            timer = asyncio.timeout(limit)
            try:
                async with timer:
                    outputs = await agent.handle(spec, cmd, state)
            except TimeoutError:
                if not timer.expired():
                    raise  # the handler's own
                raise self._timed_out(spec, limit) from None
        ran = build_outputs(agent, cmd, resource, subject, outputs, state, self.partitions, scope)
        check_sizes(ran[1], limits)
        return ran

    def decide(self, exc: BaseException, attempt: int, cause: Cause = Cause.HANDLER) -> Decision:
        """What a failure of ``prepare`` or ``run`` (or of the caller's store, with
        ``cause``) on the ``attempt``-th attempt becomes."""
        return self.policy.decide(Outcome(cause, attempt, exc))

    def _timed_out(self, spec: CommandSpec, limit: float) -> HandlerTimeout:
        """Which timeout fired, and how to raise it."""
        if spec.timeout:
            where = f"@command({spec.name!r}, timeout=...)"
        elif self.agent.timeout:
            where = f"{type(self.agent).__name__}.timeout"
        else:
            where = "handler_timeout (MESHFORGE_HANDLER_TIMEOUT)"
        return HandlerTimeout(
            f"handler {self.agent.name}.{spec.name} timed out after {limit:g}s, the limit of {where};"
            " raise it there if the handler needs longer"
        )


def check_sizes(outputs: list[StoredOutput], limits: SizeLimits) -> None:
    """An output the server would refuse could never be published: refuse the command
    before its effect is stored, instead of storing an effect whose outputs never leave."""
    for out in outputs:
        headers = out.headers
        if headers.get(H_MSG_ID) != out.msg_id:  # as it will be sent
            headers = {**headers, H_MSG_ID: out.msg_id}
        try:
            check_fits(out.subject, out.data, headers, limits)
        except PublishError as exc:
            raise Unrecoverable(f"output {out.position}: {exc}") from None
