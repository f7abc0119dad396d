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

A handler may declare its payload type instead (a ``msgspec.Struct``, a dataclass or a
Pydantic v2 model): ``def place(self, cmd: Command[PlaceOrder], state: Order)``. The
runtime then decodes and validates the payload once, before the handler, and a payload
that does not fit is dead-lettered ``invalid_payload``. Events may be typed likewise
(``Agent.events``): ``apply`` then receives them as their types, live and in replay.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar, cast

import msgspec

from meshforge.envelope import Envelope
from meshforge.errors import ConfigError, Unrecoverable
from meshforge.publish.typed import command_for
from meshforge.runtime import payloads
from meshforge.store.base import quick_init
from meshforge.topology.subjects import validate_token

__all__ = [
    "SINGLETON",
    "Agent",
    "Command",
    "CommandSpec",
    "Event",
    "Output",
    "Send",
    "command",
    "command_for",
    "derive_uuid",
]

S = TypeVar("S")
P = TypeVar("P")
F = TypeVar("F", bound=Callable[..., Any])

# Resource key of a command that names none: the agent then keeps one state.
SINGLETON = "_"
_UUID_NAMESPACE = uuid.UUID("6d657368-666f-7267-6500-000000000002")
_ENCODER = msgspec.json.Encoder()


def derive_uuid(*parts: str) -> str:
    """A UUIDv5 from ``parts``: how a handler makes a deterministic id (e.g. from ``cmd.key``)."""
    return str(uuid.uuid5(_UUID_NAMESPACE, "/".join(parts)))


class Command(Envelope, Generic[P]):
    """A command whose payload was decoded into its declared type ``P``.

    A handler declares it as its ``cmd`` parameter, ``cmd: Command[PlaceOrder]``; the
    runtime hands it a ``Command`` whose ``payload`` is a ``PlaceOrder`` (every other
    field is the envelope's).
    """

    __slots__ = ()
    payload: P  # type: ignore[assignment]

    @staticmethod
    def of(env: Envelope, payload: P) -> Command[P]:
        """``env`` with its payload replaced by the decoded ``payload`` (a copy: ``env``
        stays as it is)."""
        return _command_of(env, payload)


def _copier() -> Callable[[Envelope, Any], Command[Any]]:
    """``Command.of``, made once: one plain slot assignment per field, no loop, no calls
    (it runs for every typed command; a loop of setters cost three times the typed decode)."""
    lines = ["def of(env, payload):", "    cmd = _new(_Command)"]
    for name in (f.name for f in dataclasses.fields(Envelope)):
        lines.append(f"    cmd.{name} = {'payload' if name == 'payload' else 'env.' + name}")
    scope: dict[str, Any] = {"_new": object.__new__, "_Command": Command}
    exec("\n".join([*lines, "    return cmd"]), scope)  # as dataclasses makes __init__
    return cast(Callable[[Envelope, Any], Command[Any]], scope["of"])


_command_of = _copier()


@quick_init
@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened to the resource: ``Event("created", {"order_id": ...})``.

    ``name`` is the event verb (a subject token); the wire type is ``<agent>.<name>``.
    The payload is a dict or, for an event the agent names in ``Agent.events``, an
    instance of its type (``Event("placed", OrderPlaced(...))``).
    """

    name: str
    payload: Any = field(default_factory=dict)  # a dict, or a typed payload


@quick_init
@dataclass(frozen=True, slots=True)
class Send:
    """A command to another agent: ``Send("inventory", "reserve", {...}, resource_id=sku)``,
    or with a typed payload ``Send.to(InventoryAgent, Reserve(...))``.

    Published on ``cmd.<tenant>.<namespace>.<agent>.<command>``; tenant and namespace are
    the causing command's unless given.
    """

    agent: str
    command: str
    payload: Any = field(default_factory=dict)  # a dict, or a typed payload
    resource_id: str | None = None
    tenant: str | None = None
    namespace: str | None = None

    @classmethod
    def to(
        cls, agent: type[Agent[Any]], payload: Any, *, resource_id: str | None = None,
        tenant: str | None = None, namespace: str | None = None,
    ) -> Send:  # fmt: skip
        """A command to ``agent`` whose declared payload type is ``type(payload)``: the
        agent and command names come from its declaration, so the subject cannot be wrong
        (``ConfigError`` if no command of it, or more than one, takes that type)."""
        agent_name, command_name = command_for(agent, payload)
        return cls(agent_name, command_name, payload, resource_id, tenant, namespace)


Output: TypeAlias = Event | Send
_OUTPUT_TYPES = frozenset({Event, Send})
HandlerResult: TypeAlias = Sequence[Output] | Output | None
# A key function of a typed command takes its ``Command[P]`` (what the engine passes it).
KeySpec: TypeAlias = str | Callable[[Envelope], str] | Callable[["Command[Any]"], str] | None


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """A declared command: its name, the handler, how its resource key is found, and its
    payload type (None: a plain dict, as sent)."""

    name: str
    handler: Callable[..., HandlerResult | Awaitable[HandlerResult]]
    key: KeySpec = None
    timeout: float | None = None
    payload: type | None = None


def command(
    name: str, *, key: KeySpec = None, timeout: float | None = None, payload: type | None = None
) -> Callable[[F], F]:
    """Declare the method as the handler of command ``name``.

    ``key`` says which resource (and so which state) the command is about: a payload
    field name, a function of the envelope, or None for the envelope's ``resource_id``
    (the agent's ``resource_key`` decides). ``timeout`` (seconds) bounds an ``async def``
    handler, instead of the agent's ``timeout`` or ``handler_timeout``. ``payload`` is
    the payload's type (a ``msgspec.Struct``, a dataclass or a Pydantic v2 model); without
    it, the handler's ``cmd: Command[P]`` annotation says it, and no annotation means a
    plain dict.
    """
    validate_token(name, "command name")
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"command {name!r}: timeout must be positive seconds, got {timeout!r}")
    if payload is not None:
        payloads.decoder(payload)  # ConfigError now, not at the first command

    def mark(fn: F) -> F:
        fn.__meshforge_command__ = CommandSpec(name, fn, key, timeout, payload)  # type: ignore[attr-defined]
        if "Command[" in str(getattr(fn, "__annotations__", {}).values()):
            # The names a string annotation may use when the agent is defined inside a
            # function: that function's locals, which the annotation cannot see itself.
            body = sys._getframe(1)  # the class body
            outer = body.f_back.f_locals if body.f_back is not None else {}
            if outer is fn.__globals__:
                outer = {}
            fn.__meshforge_scope__ = {**outer, **body.f_locals}  # type: ignore[attr-defined]
        return fn

    return mark


def _annotated_payload(spec: CommandSpec, owner: type) -> type | None:
    """The payload type the handler's ``cmd`` parameter declares (``Command[P]``), or None."""
    fn = spec.handler
    params = list(inspect.signature(fn).parameters.values())
    if len(params) < 2:
        return None
    hint: Any = params[1].annotation
    if isinstance(hint, str):
        where = f"{owner.__qualname__}.{fn.__name__}"
        scope = {**getattr(fn, "__meshforge_scope__", {}), **vars(owner)}
        try:
            hint = eval(hint, fn.__globals__, scope)  # what typing.get_type_hints does
        except Exception as exc:
            if "Command[" not in hint:
                return None  # not a typed command, whatever it names
            raise ConfigError(
                f"{where}: cannot resolve the annotation {hint!r} ({exc}); define its payload"
                f" type where the agent's module sees it, or pass @command(..., payload=...)"
            ) from None
    if typing.get_origin(hint) is not Command:
        return None
    (arg,) = typing.get_args(hint)
    if typing.get_origin(arg) in (dict, Mapping) or arg in (dict, Any):
        return None
    if not payloads.is_typed(arg):
        raise ConfigError(
            f"{owner.__qualname__}.{fn.__name__}: Command[{arg!r}]: a payload type is a"
            " msgspec.Struct, a dataclass or a Pydantic v2 model"
        )
    return cast(type, arg)


def _with_payload(spec: CommandSpec, owner: type) -> CommandSpec:
    """The spec with its payload type settled (given, else inferred) and its key checked."""
    inferred = _annotated_payload(spec, owner)
    if spec.payload is not None and inferred is not None and inferred is not spec.payload:
        raise ConfigError(
            f"command {spec.name!r}: payload={payloads.type_name(spec.payload)} but the handler"
            f" declares Command[{payloads.type_name(inferred)}]"
        )
    tp = spec.payload or inferred
    if tp is None:
        return spec
    payloads.decoder(tp)
    if isinstance(spec.key, str) and spec.key not in payloads.field_names(tp):
        raise ConfigError(
            f"command {spec.name!r}: key={spec.key!r} is not a field of {payloads.type_name(tp)}"
            f" (fields: {', '.join(payloads.field_names(tp)) or 'none'})"
        )
    return dataclasses.replace(spec, payload=tp)


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
    # Event name -> payload type of the agent's typed events: ``apply`` receives their
    # payloads as these types (live and in replay). Other events' payloads stay dicts.
    events: ClassVar[Mapping[str, type]] = {}
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
                    commands[spec.name] = _with_payload(spec, cls)
        cls._commands = commands
        for event, tp in cls.events.items():
            validate_token(event, "event name")
            payloads.decoder(tp)  # ConfigError if it cannot be a payload type

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
        #: Decoders of the typed events' payloads, by event name (empty: all dicts).
        self.event_decoders: dict[str, payloads.PayloadDecoder[Any]] = {
            event: payloads.decoder(tp) for event, tp in cls.events.items()
        }

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
            value: Any = key(cast(Any, cmd))  # a Command[P] when the payload is typed
        elif spec.payload is None:
            if key not in cmd.payload:
                raise Unrecoverable(f"payload lacks {key!r}, the key of command {spec.name!r}")
            value = cmd.payload[key]
        else:  # a typed payload: the key is one of its fields (checked at declaration)
            value = getattr(cmd.payload, key)
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
