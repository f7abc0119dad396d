"""The demo agents of CONTRACT.md: orders that reserve stock from an inventory.

``order.create {"order_id"?, "sku", "qty"}`` emits ``order.created`` and sends
``inventory.reserve``; ``order.get {"order_id"}`` emits ``order.found`` or
``order.not_found``; ``inventory.create {"sku", "qty"}`` emits ``inventory.created``;
``inventory.reserve {"order_id", "sku", "qty"}`` emits ``inventory.reserved`` or
``inventory.rejected``; ``inventory.get {"sku"}`` emits ``inventory.found`` (``sku``,
``qty`` on hand, ``reserved``) or ``inventory.not_found``.

Run them with ``meshforge run meshforge.demo:OrderAgent meshforge.demo:InventoryAgent``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from meshforge.envelope import Envelope
from meshforge.errors import Unrecoverable
from meshforge.runtime.agent import Agent, Event, Output, Send, command, derive_uuid

__all__ = ["InventoryAgent", "InventoryState", "OrderAgent", "OrderState"]


class _NewOrder(msgspec.Struct, forbid_unknown_fields=False):
    sku: str
    qty: int
    order_id: str | None = None


class _NewStock(msgspec.Struct, forbid_unknown_fields=False):
    sku: str
    qty: int


class _Reserve(msgspec.Struct, forbid_unknown_fields=False):
    order_id: str
    sku: str
    qty: int


def _parse(payload: dict[str, Any], kind: type[Any], what: str) -> Any:
    try:
        value = msgspec.convert(payload, kind)
    except msgspec.ValidationError as exc:
        raise Unrecoverable(f"invalid {what} payload: {exc}") from None
    for name in ("sku", "order_id"):
        if getattr(value, name, "x") == "":
            raise Unrecoverable(f"invalid {what} payload: '{name}' is empty")
    if value.qty <= 0:
        raise Unrecoverable(f"invalid {what} payload: 'qty' must be > 0, got {value.qty}")
    return value


def order_id_of(cmd: Envelope) -> str:
    """The order a command is about: its ``order_id``, or one derived from the request key."""
    given = cmd.payload.get("order_id")
    if given is not None:
        if not isinstance(given, str) or not given:
            raise Unrecoverable(f"'order_id' must be a non-empty string, got {given!r}")
        return given
    if cmd.type.endswith(".create"):
        # Deterministic: the same request (same Idempotency-Key) names the same order.
        return derive_uuid("order", cmd.key)
    raise Unrecoverable("payload lacks 'order_id'")


class OrderState(msgspec.Struct):
    """One order: empty until created."""

    order_id: str = ""
    sku: str = ""
    qty: int = 0
    status: str = "none"


class OrderAgent(Agent[OrderState]):
    """``order.create`` and ``order.get``; keyed by ``order_id``."""

    name = "order"

    @command("create", key=order_id_of)
    def create(self, cmd: Envelope, state: OrderState) -> list[Output]:
        new = _parse(cmd.payload, _NewOrder, "order.create")
        order_id = order_id_of(cmd)
        if state.status != "none":
            raise Unrecoverable(f"order {order_id!r} already exists")
        return [
            Event("created", {"order_id": order_id, "sku": new.sku, "qty": new.qty}),
            Send("inventory", "reserve", {"order_id": order_id, "sku": new.sku, "qty": new.qty},
                 resource_id=new.sku),
        ]  # fmt: skip

    @command("get", key=order_id_of)
    def get(self, cmd: Envelope, state: OrderState) -> list[Output]:
        order_id = order_id_of(cmd)
        if state.status == "none":
            return [Event("not_found", {"order_id": order_id})]
        return [Event("found", {"order_id": order_id, "order": msgspec.to_builtins(state)})]

    def apply(self, state: OrderState, event: Event) -> OrderState:
        if event.name == "created":
            p = event.payload
            return OrderState(order_id=p["order_id"], sku=p["sku"], qty=p["qty"], status="created")
        return state


class InventoryState(msgspec.Struct):
    """Stock of one SKU: on hand and reserved."""

    sku: str = ""
    qty: int = 0
    reserved: int = 0
    exists: bool = False


class InventoryAgent(Agent[InventoryState]):
    """``inventory.create``, ``inventory.reserve`` and ``inventory.get``; keyed by ``sku``."""

    name = "inventory"

    @command("create", key="sku")
    def create(self, cmd: Envelope, state: InventoryState) -> list[Output]:
        new = _parse(cmd.payload, _NewStock, "inventory.create")
        if state.exists:
            raise Unrecoverable(f"inventory for sku {new.sku!r} already exists")
        return [Event("created", {"sku": new.sku, "qty": new.qty})]

    @command("reserve", key="sku")
    def reserve(self, cmd: Envelope, state: InventoryState) -> list[Output]:
        r = _parse(cmd.payload, _Reserve, "inventory.reserve")
        available = state.qty - state.reserved
        if not state.exists or available < r.qty:
            reason = "unknown sku" if not state.exists else "not enough stock"
            return [Event("rejected", {"order_id": r.order_id, "sku": r.sku, "qty": r.qty,
                                       "available": max(available, 0), "reason": reason})]  # fmt: skip
        return [Event("reserved", {"order_id": r.order_id, "sku": r.sku, "qty": r.qty})]

    @command("get", key="sku")
    def get(self, cmd: Envelope, state: InventoryState) -> list[Output]:
        sku = str(cmd.payload["sku"])
        if not state.exists:
            return [Event("not_found", {"sku": sku})]
        return [Event("found", {"sku": sku, "qty": state.qty, "reserved": state.reserved})]

    def apply(self, state: InventoryState, event: Event) -> InventoryState:
        p = event.payload
        if event.name == "created":
            return InventoryState(sku=p["sku"], qty=p["qty"], exists=True)
        if event.name == "reserved":
            return msgspec.structs.replace(state, reserved=state.reserved + p["qty"])
        return state
