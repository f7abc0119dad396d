"""A short typed agent: run it with `meshforge run examples.order_agent:Orders` (from the repo root).

``shop.place`` is decoded into ``PlaceOrder`` before ``place`` runs (a payload that does not
fit is a dead letter ``invalid_payload``); the reservation goes to the demo's inventory.
"""

import msgspec

from meshforge.demo import InventoryAgent, ReserveStock
from meshforge.runtime import Agent, Command, Event, Send, command


class PlaceOrder(msgspec.Struct):
    order_id: str
    sku: str
    qty: int


class OrderPlaced(msgspec.Struct):
    sku: str
    qty: int


class Order(msgspec.Struct):
    sku: str = ""
    qty: int = 0


class Orders(Agent[Order]):
    name = "shop"
    events = {"placed": OrderPlaced}

    @command("place", key="order_id")
    def place(self, cmd: Command[PlaceOrder], state: Order):
        p = cmd.payload
        if state.sku:
            return [Event("duplicate", {"order_id": p.order_id})]
        reserve = ReserveStock(p.order_id, p.sku, p.qty)
        return [
            Event("placed", OrderPlaced(p.sku, p.qty)),
            Send.to(InventoryAgent, reserve, resource_id=p.sku),
        ]

    def apply(self, state: Order, event: Event) -> Order:
        if isinstance(event.payload, OrderPlaced):
            return Order(sku=event.payload.sku, qty=event.payload.qty)
        return state
