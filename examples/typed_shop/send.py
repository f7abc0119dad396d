"""Sending typed commands: the subject and the type come from the agents' declarations."""

from __future__ import annotations

from meshforge import Publisher, PublishResult, SyncPublisher

from .agents import PlaceOrder, Shop


async def place(publisher: Publisher, order_id: str, sku: str, qty: int) -> PublishResult:
    """``cmd.<tenant>.shop.shop.place``, from a coroutine."""
    return await publisher.send(
        Shop, PlaceOrder(order_id=order_id, sku=sku, qty=qty), namespace="shop"
    )


def place_now(publisher: SyncPublisher, order_id: str, sku: str, qty: int) -> PublishResult:
    """The same from a thread or a web view (blocks until the server stored it)."""
    return publisher.send(Shop, PlaceOrder(order_id=order_id, sku=sku, qty=qty), namespace="shop")
