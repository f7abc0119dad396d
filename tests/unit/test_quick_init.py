"""Records the engine makes for every command keep every dataclass behaviour with a
quicker ``__init__`` (``meshforge.store.base.quick_init``)."""

from __future__ import annotations

import dataclasses
import inspect
from datetime import UTC, datetime
from typing import Any

import pytest

from meshforge.runtime.agent import Event, Send
from meshforge.store.base import (
    NewEffect,
    NewEvent,
    NewState,
    StoredEvent,
    StoredOutput,
    quick_init,
)
from meshforge.topology.scope import Scope

SCOPE = Scope("t1", "ns1")
NOW = datetime(2026, 11, 27, tzinfo=UTC)
# Every field given, in order.
GIVEN: list[tuple[type, tuple[Any, ...]]] = [
    (StoredOutput, (1, "evt.a.b.c.d", "m-1", b"body", {"A": "b"})),
    (NewEvent, ("e-1", "a.done", "r-1", "c-1", "k-1", b"{}", "2026-11-27T00:00:00Z")),
    (StoredEvent, ("e-1", "a.done", None, "c-1", "k-1", b"{}", "ts", "a", 7, NOW, SCOPE)),
    (NewState, ("r-1", b"{}", 3, SCOPE)),
    (NewEffect, ("k-1", "c-1", [], SCOPE)),
    (Event, ("done", {"x": 1})),
    (Send, ("inventory", "reserve", {"sku": "A"}, "r-1", "t2", "ns2")),
]


def _twin(cls: type) -> type:
    """The same fields as a plain frozen, slotted dataclass."""
    specs = [(f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory))
             for f in dataclasses.fields(cls)]  # fmt: skip
    return dataclasses.make_dataclass(cls.__name__, specs, frozen=True, slots=True)


@pytest.mark.parametrize(("cls", "values"), GIVEN, ids=lambda v: getattr(v, "__name__", ""))
def test_a_record_is_what_a_plain_dataclass_would_be(cls: type, values: tuple[Any, ...]) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    twin = _twin(cls)
    assert str(inspect.signature(cls)) == str(inspect.signature(twin))
    by_position, by_name = cls(*values), cls(**dict(zip(names, values, strict=True)))
    assert by_position == by_name and dataclasses.astuple(by_position) == dataclasses.astuple(
        twin(*values)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(by_position, names[0], values[0])
    assert dataclasses.replace(by_position, **{names[0]: values[0]}) == by_position
    required = [
        f for f in dataclasses.fields(cls) if f.default is f.default_factory is dataclasses.MISSING
    ]
    with pytest.raises(TypeError, match="missing"):
        cls(*values[: len(required) - 1])
    with pytest.raises(TypeError):
        cls(*values, "one too many")


def test_defaults_and_fresh_default_factories() -> None:
    a, b = StoredOutput(0, "s", "m", b""), StoredOutput(0, "s", "m", b"")
    assert a.headers == {} and a.headers is not b.headers
    assert Event("x").payload == {} and NewState("r", b"", 1).scope == Scope("default", "default")
    assert Send("a", "b").resource_id is None


def test_a_class_it_cannot_serve_is_refused() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Later:
        a: int

        def __post_init__(self) -> None: ...

    with pytest.raises(TypeError, match="__post_init__"):
        quick_init(Later)
