"""A twenty-line agent: run it with `meshforge run examples.order_agent:Orders` (from the repo root)."""

import msgspec

from meshforge.runtime import Agent, Event, Send, command


class Order(msgspec.Struct):
    sku: str = ""
    qty: int = 0


class Orders(Agent[Order]):
    name = "shop"

    @command("place", key="order_id")
    def place(self, cmd, state: Order):
        if state.sku:
            return [Event("duplicate", {"order_id": cmd.payload["order_id"]})]
        p = cmd.payload
        return [Event("placed", p), Send("inventory", "reserve", p, resource_id=p["sku"])]

    def apply(self, state: Order, event: Event) -> Order:
        if event.name == "placed":
            return Order(sku=event.payload["sku"], qty=event.payload["qty"])
        return state
