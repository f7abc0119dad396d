"""Typed payloads: a command's or an event's payload as a ``msgspec.Struct``, a dataclass,
or a Pydantic v2 model (when Pydantic is installed), decoded and validated in one pass.

A command's payload is decoded straight from the received body by a small struct that
holds only ``payload: P`` (the envelope's other fields are skipped, never built), so a
payload is parsed once, into its type, and a value that does not fit is found before the
handler runs. A Pydantic model is read by Pydantic itself from the payload's raw JSON.
Whatever does not fit raises ``InvalidPayload``, whose text names the field path and the
expected type: it becomes the dead letter's ``Dlq-Error``.

Example::

    class PlaceOrder(msgspec.Struct):
        order_id: str
        qty: int

    dec = decoder(PlaceOrder)
    dec.decode(b'{"order_id": "o-1", "qty": 2}')      # PlaceOrder(order_id='o-1', qty=2)
    dec.decode(b'{"order_id": "o-1", "qty": "2"}')    # InvalidPayload: ... at `$.qty`
    to_builtins(PlaceOrder("o-1", 2))                 # {'order_id': 'o-1', 'qty': 2}
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Generic, TypeVar, cast

import msgspec

from meshforge.errors import ConfigError, InvalidPayload

# Shared with the publishers, which sit below the runtime (``meshforge.publish.typed``).
from meshforge.publish.typed import is_pydantic, to_builtins, type_name

__all__ = [
    "PayloadDecoder",
    "decoder",
    "encode",
    "field_names",
    "is_pydantic",
    "is_typed",
    "json_schema",
    "to_builtins",
    "type_name",
]

P = TypeVar("P")
_ENCODER = msgspec.json.Encoder()


class _RawBody(msgspec.Struct):
    """An envelope body with only its payload, kept as raw JSON (for Pydantic)."""

    payload: msgspec.Raw


def is_typed(tp: object) -> bool:
    """Whether ``tp`` can be a declared payload type: a ``msgspec.Struct`` subclass, a
    dataclass, or a Pydantic v2 model."""
    if not isinstance(tp, type):
        return False
    return issubclass(tp, msgspec.Struct) or dataclasses.is_dataclass(tp) or is_pydantic(tp)


def field_names(tp: type) -> tuple[str, ...]:
    """The field names of a payload type (what ``key="field"`` may name)."""
    if issubclass(tp, msgspec.Struct):
        return tuple(tp.__struct_fields__)
    if dataclasses.is_dataclass(tp):
        return tuple(f.name for f in dataclasses.fields(tp))
    return tuple(cast(Any, tp).model_fields)


def _fitting_error(tp: type, text: str) -> InvalidPayload:
    return InvalidPayload(f"payload does not fit {type_name(tp)}: {text}")


def _pydantic_error(tp: type, exc: Any) -> InvalidPayload:
    """A Pydantic ValidationError as one line: the first error's message and path."""
    errors = exc.errors(include_url=False)
    if not errors:
        return _fitting_error(tp, str(exc))
    first = errors[0]
    path = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return _fitting_error(tp, f"{first['msg']} - at `{path}`{more}")


class PayloadDecoder(Generic[P]):
    """Decodes and validates payloads of one type; see the module docstring.

    ``decode_body`` reads a whole envelope body and decodes only its ``payload``;
    ``decode`` reads a payload's own JSON (a stored event's data); ``convert`` takes
    JSON-ready builtins (a dict). Each raises ``InvalidPayload`` and nothing else.
    """

    __slots__ = ("_body", "_payload", "pydantic", "type")

    def __init__(self, tp: type[P]) -> None:
        self.type = tp
        self.pydantic = is_pydantic(tp)
        if self.pydantic:
            self._body: msgspec.json.Decoder[Any] = msgspec.json.Decoder(_RawBody)
            self._payload: msgspec.json.Decoder[Any] | None = None
            return
        if not is_typed(tp):
            raise ConfigError(
                f"payload type {tp!r} must be a msgspec.Struct, a dataclass or a Pydantic v2 model"
            )
        body = msgspec.defstruct(f"{type_name(tp)}Body", [("payload", tp)])
        try:
            self._body = msgspec.json.Decoder(body)
            self._payload = msgspec.json.Decoder(tp)
        except TypeError as exc:  # a field type msgspec cannot decode
            raise ConfigError(f"payload type {type_name(tp)}: {exc}") from None

    def decode_body(self, data: bytes | bytearray | memoryview) -> P:
        """The ``payload`` of an envelope body, as a ``P`` (the rest of the body is skipped)."""
        if self.pydantic:
            try:
                raw = self._body.decode(data).payload
            except msgspec.DecodeError as exc:
                raise _fitting_error(self.type, str(exc)) from None
            return self._pydantic_json(raw)
        try:
            return cast(P, self._body.decode(data).payload)
        except msgspec.ValidationError as exc:
            # Paths are the payload's own: `$.payload.qty` is the payload's `$.qty`.
            raise _fitting_error(self.type, str(exc).replace("`$.payload", "`$")) from None
        except msgspec.DecodeError as exc:
            raise _fitting_error(self.type, str(exc)) from None

    def decode(self, data: bytes | bytearray | memoryview) -> P:
        """A payload's own JSON as a ``P``."""
        if self._payload is None:
            return self._pydantic_json(data)
        try:
            return cast(P, self._payload.decode(data))
        except msgspec.DecodeError as exc:
            raise _fitting_error(self.type, str(exc)) from None

    def convert(self, obj: Any) -> P:
        """JSON-ready builtins (a dict) as a ``P``, validated as ``decode`` would."""
        if self._payload is None:
            return self._pydantic_json(_ENCODER.encode(obj))
        try:
            return msgspec.convert(obj, self.type)
        except msgspec.ValidationError as exc:
            raise _fitting_error(self.type, str(exc)) from None

    def _pydantic_json(self, data: bytes | bytearray | memoryview) -> P:
        from pydantic import ValidationError

        try:
            return cast(P, cast(Any, self.type).model_validate_json(bytes(data)))
        except ValidationError as exc:
            raise _pydantic_error(self.type, exc) from None


@functools.cache
def decoder(tp: type[P]) -> PayloadDecoder[P]:
    """The (shared) decoder of payload type ``tp``; ``ConfigError`` if ``tp`` cannot be one."""
    return PayloadDecoder(tp)


def encode(obj: Any) -> bytes:
    """A payload as JSON bytes (a typed payload as its fields)."""
    if type(obj) is dict or isinstance(obj, msgspec.Struct) or dataclasses.is_dataclass(obj):
        return _ENCODER.encode(obj)
    return _ENCODER.encode(to_builtins(obj))


def json_schema(tp: type) -> dict[str, Any]:
    """The JSON Schema of a payload type (msgspec's for a Struct or a dataclass, Pydantic's
    ``model_json_schema()`` for a model)."""
    if is_pydantic(tp):
        return cast(dict[str, Any], cast(Any, tp).model_json_schema())
    if not is_typed(tp):
        raise ConfigError(
            f"payload type {tp!r} must be a msgspec.Struct, a dataclass or a Pydantic v2 model"
        )
    return msgspec.json.schema(tp)
