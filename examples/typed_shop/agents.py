"""Two typed agents: every payload is a declared type, checked by the runtime on the way in
and by a type checker in the code (this package type-checks under ``mypy --strict``).

Run them with ``meshforge run examples.typed_shop.agents:Shop
examples.typed_shop.agents:Inventory`` (from the repository's root).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from meshforge import Agent, Command, Event, Send, command
from meshforge.runtime import Output

Sku = Annotated[str, msgspec.Meta(min_length=1)]
Quantity = Annotated[int, msgspec.Meta(gt=0)]


class PlaceOrder(msgspec.Struct, frozen=True):
    """``shop.place``: a command is decoded into this before ``Shop.place`` runs."""

    order_id: str
    sku: Sku
    qty: Quantity
    note: str | None = None  # added later: optional, so older commands still decode


class OrderPlaced(msgspec.Struct, frozen=True):
    order_id: str
    sku: str
    qty: int


class Reserve(msgspec.Struct, frozen=True):
    """``stock.reserve``, sent by ``shop.place``."""

    order_id: str
    sku: Sku
    qty: Quantity


class Reserved(msgspec.Struct, frozen=True):
    sku: str
    qty: int


class Order(msgspec.Struct):
    sku: str = ""
    qty: int = 0


class Stock(msgspec.Struct):
    reserved: int = 0


class Shop(Agent[Order]):
    name = "shop"
    events = {"placed": OrderPlaced}

    @command("place", key="order_id")
    def place(self, cmd: Command[PlaceOrder], state: Order) -> list[Output]:
        p = cmd.payload
        return [
            Event("placed", OrderPlaced(order_id=p.order_id, sku=p.sku, qty=p.qty)),
            Send.to(
                Inventory, Reserve(order_id=p.order_id, sku=p.sku, qty=p.qty), resource_id=p.sku
            ),
        ]

    def apply(self, state: Order, event: Event) -> Order:
        placed = event.payload
        if isinstance(placed, OrderPlaced):
            return Order(sku=placed.sku, qty=placed.qty)
        return state


class Inventory(Agent[Stock]):
    name = "stock"
    events = {"reserved": Reserved}

    @command("reserve", key="sku")
    def reserve(self, cmd: Command[Reserve], state: Stock) -> list[Output]:
        return [Event("reserved", Reserved(sku=cmd.payload.sku, qty=cmd.payload.qty))]

    def apply(self, state: Stock, event: Event) -> Stock:
        if isinstance(event.payload, Reserved):
            return Stock(reserved=state.reserved + event.payload.qty)
        return state
