"""How a user writes a control-plane node: a class whose ``@command`` methods run commands.

A command handler gets the command's payload and a ``CommandContext``; what it returns
(anything JSON can hold) becomes the reply's ``result``. Raising ends the attempt:
``Unrecoverable`` (or any ``MeshForgeError`` meant as final, see the runtime) replies
``error`` at once; other exceptions are retried up to ``max_deliver`` runs.

Example::

    class Thermostat(Node):
        version = "2.1"

        @command()
        async def set_point(self, payload: dict[str, Any], ctx: CommandContext) -> Any:
            self.target = float(payload["celsius"])
            return {"target": self.target, "epoch": ctx.epoch}

    # meshforge node lab1 room4 mypkg.thermo:Thermostat
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from typing import Any, ClassVar, TypeVar, cast

from meshforge.envelope import Envelope
from meshforge.errors import ConfigError

__all__ = ["CommandContext", "CommandHandler", "Node", "command", "load_node", "package_version"]

CommandHandler = Callable[[dict[str, Any], "CommandContext"], Awaitable[Any]]
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

_COMMAND_ATTR = "__meshforge_command__"


def package_version() -> str:
    """The installed MeshForge version (``0+unknown`` when run from a bare source tree)."""
    try:
        return _dist_version("meshforge")
    except PackageNotFoundError:
        return "0+unknown"


def command(name: str | None = None) -> Callable[[F], F]:
    """Mark a ``Node`` method as the handler of command ``name`` (default: the method's name).

    Example::

        @command("reboot")
        async def do_reboot(self, payload, ctx): ...
    """

    def mark(fn: F) -> F:
        if not inspect.iscoroutinefunction(cast(Any, fn)):  # cast: keep F un-narrowed
            raise TypeError(f"command handler {fn.__qualname__} must be 'async def'")
        setattr(fn, _COMMAND_ATTR, name or fn.__name__)
        return fn

    return mark


@dataclass
class CommandContext:
    """What a handler knows about the command it runs and the node it runs on."""

    site: str
    node: str
    epoch: int
    envelope: Envelope
    restart_requested: bool = field(default=False)

    @property
    def command_id(self) -> str:
        return self.envelope.id

    @property
    def command(self) -> str:
        return self.envelope.type

    def restart(self) -> None:
        """Ask for a simulated restart: the epoch is bumped in the same transaction that
        stores this command's reply, so it happens once even if the node is killed."""
        self.restart_requested = True


class Node:
    """Base class of a node; subclasses mark handlers with ``@command``.

    ``version`` is announced in presence. ``on_start`` / ``on_stop`` run when the node
    starts (after its epoch was counted) and stops. Handlers may also be added at run
    time with ``add_command``.
    """

    version: ClassVar[str] = package_version()
    _declared: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                name = getattr(value, _COMMAND_ATTR, None)
                if isinstance(name, str):
                    declared[name] = attr
        cls._declared = declared

    def __init__(self) -> None:
        self._extra: dict[str, CommandHandler] = {}

    def add_command(self, name: str, handler: CommandHandler) -> None:
        """Register ``async handler(payload, ctx)`` for command ``name``."""
        if not inspect.iscoroutinefunction(handler):
            raise TypeError(f"command handler for {name!r} must be 'async def'")
        self._extra[name] = handler

    def commands(self) -> list[str]:
        """The names of every command this node runs, sorted."""
        return sorted({*self._declared, *getattr(self, "_extra", {})})

    def handler_for(self, name: str) -> CommandHandler | None:
        """The handler of command ``name``, or None when the node has none."""
        extra: dict[str, CommandHandler] = getattr(self, "_extra", {})
        if name in extra:
            return extra[name]
        attr = self._declared.get(name)
        if attr is None:
            return None
        handler: CommandHandler = getattr(self, attr)
        return handler

    async def on_start(self, site: str, node: str, epoch: int) -> None:
        """Called once the node's epoch is counted, before the first command runs."""

    async def on_stop(self) -> None:
        """Called after the last command finished, when the node stops."""


def load_node(spec: str) -> Node:
    """The node named by ``module:Name`` (a Node subclass, a factory, or an instance).

    Example: ``load_node("meshforge.demo:DemoNode")``. Raises ConfigError naming the spec.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"node {spec!r}: expected MODULE:NAME, e.g. meshforge.demo:DemoNode")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"node {spec!r}: cannot import {module_name!r}: {exc}") from None
    target = getattr(module, attr, None)
    if target is None:
        raise ConfigError(f"node {spec!r}: module {module_name!r} has no {attr!r}")
    instance = (
        target()
        if isinstance(target, type) or (callable(target) and not isinstance(target, Node))
        else target
    )
    if not isinstance(instance, Node):
        raise ConfigError(
            f"node {spec!r}: expected a meshforge.control.Node, got {type(instance).__name__}"
        )
    return instance
