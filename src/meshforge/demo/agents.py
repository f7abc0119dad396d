"""The demo agents of CONTRACT.md: orders that reserve stock from an inventory.

``order.create {"order_id"?, "sku", "qty"}`` emits ``order.created`` and sends
``inventory.reserve``; ``order.get {"order_id"}`` emits ``order.found`` or
``order.not_found``; ``inventory.create {"sku", "qty"}`` emits ``inventory.created``;
``inventory.reserve {"order_id", "sku", "qty"}`` emits ``inventory.reserved`` or
``inventory.rejected``; ``inventory.get {"sku"}`` emits ``inventory.found`` (``sku``,
``qty`` on hand, ``reserved``) or ``inventory.not_found``.

Every payload is a declared type: the runtime decodes each command into its Struct before
the handler runs, and a command that does not fit (a field missing or of the wrong type,
an empty ``sku``, a ``qty`` not above 0) is a dead letter ``invalid_payload`` naming the
field. Events are typed too (``events``), so ``apply`` reads fields, not dict keys.

Run them with ``meshforge run meshforge.demo:OrderAgent meshforge.demo:InventoryAgent``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from meshforge.errors import Unrecoverable
from meshforge.runtime.agent import Agent, Command, Event, Output, Send, command, derive_uuid

__all__ = [
    "CreateOrder",
    "CreateStock",
    "GetOrder",
    "GetStock",
    "InventoryAgent",
    "InventoryState",
    "OrderAgent",
    "OrderState",
    "ReserveStock",
]

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
Positive = Annotated[int, msgspec.Meta(gt=0)]


class CreateOrder(msgspec.Struct, frozen=True):
    """``order.create``: without ``order_id``, one is derived from the request's key."""

    sku: NonEmpty
    qty: Positive
    order_id: NonEmpty | None = None


class GetOrder(msgspec.Struct, frozen=True):
    """``order.get``."""

    order_id: NonEmpty


class CreateStock(msgspec.Struct, frozen=True):
    """``inventory.create``."""

    sku: NonEmpty
    qty: Positive


class ReserveStock(msgspec.Struct, frozen=True):
    """``inventory.reserve``, sent by ``order.create``."""

    order_id: NonEmpty
    sku: NonEmpty
    qty: Positive


class GetStock(msgspec.Struct, frozen=True):
    """``inventory.get``."""

    sku: NonEmpty


class OrderState(msgspec.Struct):
    """One order: empty until created."""

    order_id: str = ""
    sku: str = ""
    qty: int = 0
    status: str = "none"


class OrderCreated(msgspec.Struct, frozen=True):
    order_id: str
    sku: str
    qty: int


class OrderFound(msgspec.Struct, frozen=True):
    order_id: str
    order: OrderState


class OrderNotFound(msgspec.Struct, frozen=True):
    order_id: str


def order_id_of(cmd: Command[CreateOrder] | Command[GetOrder]) -> str:
    """The order a command is about: its ``order_id``, or one derived from the request key."""
    given = cmd.payload.order_id
    if given is not None:
        return given
    # Deterministic: the same request (same Idempotency-Key) names the same order.
    return derive_uuid("order", cmd.key)


class OrderAgent(Agent[OrderState]):
    """``order.create`` and ``order.get``; keyed by ``order_id``."""

    name = "order"
    events = {"created": OrderCreated, "found": OrderFound, "not_found": OrderNotFound}

    @command("create", key=order_id_of)
    def create(self, cmd: Command[CreateOrder], state: OrderState) -> list[Output]:
        new = cmd.payload
        order_id = order_id_of(cmd)
        if state.status != "none":
            raise Unrecoverable(f"order {order_id!r} already exists")
        return [
            Event("created", OrderCreated(order_id, new.sku, new.qty)),
            Send.to(InventoryAgent, ReserveStock(order_id, new.sku, new.qty), resource_id=new.sku),
        ]

    @command("get", key="order_id")
    def get(self, cmd: Command[GetOrder], state: OrderState) -> list[Output]:
        order_id = cmd.payload.order_id
        if state.status == "none":
            return [Event("not_found", OrderNotFound(order_id))]
        return [Event("found", OrderFound(order_id, state))]

    def apply(self, state: OrderState, event: Event) -> OrderState:
        p = event.payload
        if isinstance(p, OrderCreated):
            return OrderState(order_id=p.order_id, sku=p.sku, qty=p.qty, status="created")
        return state


class InventoryState(msgspec.Struct):
    """Stock of one SKU: on hand and reserved."""

    sku: str = ""
    qty: int = 0
    reserved: int = 0
    exists: bool = False


class StockCreated(msgspec.Struct, frozen=True):
    sku: str
    qty: int


class StockReserved(msgspec.Struct, frozen=True):
    order_id: str
    sku: str
    qty: int


class StockRejected(msgspec.Struct, frozen=True):
    order_id: str
    sku: str
    qty: int
    available: int
    reason: str


class StockFound(msgspec.Struct, frozen=True):
    sku: str
    qty: int
    reserved: int


class StockNotFound(msgspec.Struct, frozen=True):
    sku: str


class InventoryAgent(Agent[InventoryState]):
    """``inventory.create``, ``inventory.reserve`` and ``inventory.get``; keyed by ``sku``."""

    name = "inventory"
    events = {
        "created": StockCreated,
        "reserved": StockReserved,
        "rejected": StockRejected,
        "found": StockFound,
        "not_found": StockNotFound,
    }

    @command("create", key="sku")
    def create(self, cmd: Command[CreateStock], state: InventoryState) -> list[Output]:
        new = cmd.payload
        if state.exists:
            raise Unrecoverable(f"inventory for sku {new.sku!r} already exists")
        return [Event("created", StockCreated(new.sku, new.qty))]

    @command("reserve", key="sku")
    def reserve(self, cmd: Command[ReserveStock], state: InventoryState) -> list[Output]:
        r = cmd.payload
        available = state.qty - state.reserved
        if not state.exists or available < r.qty:
            reason = "unknown sku" if not state.exists else "not enough stock"
            return [Event("rejected", StockRejected(r.order_id, r.sku, r.qty,
                                                    max(available, 0), reason))]  # fmt: skip
        return [Event("reserved", StockReserved(r.order_id, r.sku, r.qty))]

    @command("get", key="sku")
    def get(self, cmd: Command[GetStock], state: InventoryState) -> list[Output]:
        sku = cmd.payload.sku
        if not state.exists:
            return [Event("not_found", StockNotFound(sku))]
        return [Event("found", StockFound(sku, state.qty, state.reserved))]

    def apply(self, state: InventoryState, event: Event) -> InventoryState:
        p = event.payload
        if isinstance(p, StockCreated):
            return InventoryState(sku=p.sku, qty=p.qty, exists=True)
        if isinstance(p, StockReserved):
            return msgspec.structs.replace(state, reserved=state.reserved + p.qty)
        return state
