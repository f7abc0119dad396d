"""How a user writes an agent: a name, an event-sourced state, and one handler per command.

A handler receives the command's envelope and the current state of the resource the
command is about, and returns outputs: ``Event``\\ s (folded into the state by ``apply``,
stored in the agent's event log and published on ``evt.<tenant>.<ns>.<agent>.<event>``)
and ``Send``\\ s (commands to other agents). Handlers must be deterministic given the
command and the state: no clock, no randomness, no I/O whose answer changes. The
engine then gives each command exactly one effect however often it is delivered.

Example::

    class Counter(msgspec.Struct):
        total: int = 0

    class CounterAgent(Agent[Counter]):
        name = "counter"

        @command("add", key="counter_id")
        def add(self, cmd: Envelope, state: Counter) -> list[Output]:
            return [Event("added", {"n": int(cmd.payload["n"])})]

        def apply(self, state: Counter, event: Event) -> Counter:
            if event.name == "added":
                return Counter(total=state.total + event.payload["n"])
            return state
"""

from __future__ import annotations

import inspect
import typing
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar, cast

import msgspec

from meshforge.envelope import Envelope
from meshforge.errors import ConfigError, Unrecoverable
from meshforge.store.base import quick_init
from meshforge.topology.subjects import validate_token

__all__ = [
    "SINGLETON",
    "Agent",
    "CommandSpec",
    "Event",
    "Output",
    "Send",
    "command",
    "derive_uuid",
]

S = TypeVar("S")
F = TypeVar("F", bound=Callable[..., Any])

# Resource key of a command that names none: the agent then keeps one state.
SINGLETON = "_"
_UUID_NAMESPACE = uuid.UUID("6d657368-666f-7267-6500-000000000002")
_ENCODER = msgspec.json.Encoder()


def derive_uuid(*parts: str) -> str:
    """A UUIDv5 from ``parts``: how a handler makes a deterministic id (e.g. from ``cmd.key``)."""
    return str(uuid.uuid5(_UUID_NAMESPACE, "/".join(parts)))


@quick_init
@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened to the resource: ``Event("created", {"order_id": ...})``.

    ``name`` is the event verb (a subject token); the wire type is ``<agent>.<name>``.
    """

    name: str
    payload: Mapping[str, Any] = field(default_factory=dict)


@quick_init
@dataclass(frozen=True, slots=True)
class Send:
    """A command to another agent: ``Send("inventory", "reserve", {...}, resource_id=sku)``.

    Published on ``cmd.<tenant>.<namespace>.<agent>.<command>``; tenant and namespace are
    the causing command's unless given.
    """

    agent: str
    command: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    resource_id: str | None = None
    tenant: str | None = None
    namespace: str | None = None


Output: TypeAlias = Event | Send
_OUTPUT_TYPES = frozenset({Event, Send})
HandlerResult: TypeAlias = Sequence[Output] | Output | None
KeySpec: TypeAlias = str | Callable[[Envelope], str] | None


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """A declared command: its name, the handler, and how its resource key is found."""

    name: str
    handler: Callable[..., HandlerResult | Awaitable[HandlerResult]]
    key: KeySpec = None
    timeout: float | None = None


def command(name: str, *, key: KeySpec = None, timeout: float | None = None) -> Callable[[F], F]:
    """Declare the method as the handler of command ``name``.

    ``key`` says which resource (and so which state) the command is about: a payload
    field name, a function of the envelope, or None for the envelope's ``resource_id``
    (the agent's ``resource_key`` decides). ``timeout`` (seconds) bounds an ``async def``
    handler, instead of the agent's ``timeout`` or ``handler_timeout``.
    """
    validate_token(name, "command name")
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"command {name!r}: timeout must be positive seconds, got {timeout!r}")

    def mark(fn: F) -> F:
        fn.__meshforge_command__ = CommandSpec(name, fn, key, timeout)  # type: ignore[attr-defined]
        return fn

    return mark


def _state_type_of(cls: type) -> type | None:
    for base in getattr(cls, "__orig_bases__", ()):
        if typing.get_origin(base) is Agent:
            (arg,) = typing.get_args(base)
            return arg if isinstance(arg, type) else None
    return None


class Agent(Generic[S]):
    """Base of every agent; subclass with ``Agent[YourState]`` and set ``name``.

    The state type is a ``msgspec.Struct`` or a dataclass; its ``initial()`` classmethod
    (or its no-argument constructor) gives the state of a resource never seen before.
    """

    name: ClassVar[str]
    state_type: ClassVar[type[Any]]
    # Extra exception types that mean "this command can never succeed": dead-lettered.
    unrecoverable: ClassVar[tuple[type[BaseException], ...]] = ()
    # True: a dead-lettered command keeps its resource's later commands waiting until an
    # operator re-drives it or releases the resource (``meshforge holds release``).
    hold_after_dead_letter: ClassVar[bool] = False
    # Seconds an ``async def`` handler of this agent may take (None: ``handler_timeout``).
    timeout: ClassVar[float | None] = None
    _commands: ClassVar[dict[str, CommandSpec]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        inferred = _state_type_of(cls)
        if inferred is not None and "state_type" not in cls.__dict__:
            cls.state_type = inferred
        commands: dict[str, CommandSpec] = {}
        for klass in reversed(cls.__mro__):
            for attr in vars(klass).values():
                spec = getattr(attr, "__meshforge_command__", None)
                if isinstance(spec, CommandSpec):
                    commands[spec.name] = spec
        cls._commands = commands

    def __init__(self) -> None:
        cls = type(self)
        name = getattr(cls, "name", None)
        if not isinstance(name, str):
            raise ConfigError(f"agent {cls.__qualname__}: set the class attribute 'name'")
        validate_token(name, "agent name")
        if not isinstance(getattr(cls, "state_type", None), type):
            raise ConfigError(
                f"agent {cls.__qualname__}: give the state type as Agent[State] or 'state_type'"
            )
        self._decoder = msgspec.json.Decoder(cls.state_type)

    # ------------------------------------------------------------------ commands

    @classmethod
    def commands(cls) -> dict[str, CommandSpec]:
        """The declared commands by name."""
        return dict(cls._commands)

    def resource_key(self, cmd: Envelope, spec: CommandSpec) -> str:
        """The resource a command is about: its ``key`` spec, else ``resource_id``, else one state."""
        key = spec.key
        if key is None:
            return cmd.resource_id or SINGLETON
        if callable(key):
            value: Any = key(cmd)
        else:
            if key not in cmd.payload:
                raise Unrecoverable(f"payload lacks {key!r}, the key of command {spec.name!r}")
            value = cmd.payload[key]
        if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
            raise Unrecoverable(
                f"resource key of command {spec.name!r} must be a non-empty string, got {value!r}"
            )
        return str(value)

    async def handle(self, spec: CommandSpec, cmd: Envelope, state: S) -> list[Output]:
        """Run the command's handler and return its outputs as a list (checked)."""
        result = spec.handler(self, cmd, state)
        if type(result) is list and _OUTPUT_TYPES.issuperset(map(type, result)):
            return list(result)  # the common case, checked in one C pass
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            return []
        if isinstance(result, Event | Send):
            return [result]
        if not isinstance(result, list | tuple):
            raise Unrecoverable(
                f"handler of {spec.name!r} returned {type(result).__name__}; expected a list of Event/Send"
            )
        outputs = list(result)
        for item in outputs:
            if not isinstance(item, Event | Send):
                raise Unrecoverable(
                    f"handler of {spec.name!r} returned {type(item).__name__}; expected Event or Send"
                )
        return outputs

    # ------------------------------------------------------------------ state

    def initial(self) -> S:
        """The state of a resource with no events yet."""
        make = getattr(self.state_type, "initial", None)
        return cast(S, make() if callable(make) else self.state_type())

    def apply(self, state: S, event: Event) -> S:
        """Fold one of this agent's events into the state; override it (default: unchanged)."""
        return state

    def encode_state(self, state: S) -> bytes:
        """The state as canonical JSON bytes (what the store keeps)."""
        return _ENCODER.encode(state)

    def decode_state(self, data: bytes) -> S:
        """A state back from ``encode_state`` bytes."""
        return cast(S, self._decoder.decode(data))
