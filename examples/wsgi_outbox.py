"""A web app that sends messages reliably: the transactional outbox and SyncPublisher.

``POST /orders {"order_id", "sku", "qty"}`` writes the order AND the command to reserve
its stock in one database transaction (the outbox): both are stored or neither is, and
``meshforge relay`` publishes the command afterwards. The request is read into a typed
``OrderRequest`` (a body that does not fit is a 400 naming the field), and the command is
the demo inventory's typed ``ReserveStock``, addressed by the agent's declaration. ``POST /notes {"text"}`` publishes
an event at once through a ``SyncPublisher`` (no database write to keep in step).

Serve it with any WSGI server (gunicorn, uWSGI, or the standard library's)::

    MESHFORGE_STORE_URL=sqlite:///shop.db python examples/wsgi_outbox.py   # port 8000
    meshforge relay --store sqlite:///shop.db                              # beside it
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from meshforge import SyncPublisher
from meshforge.config import Settings
from meshforge.demo import InventoryAgent, ReserveStock
from meshforge.errors import MeshForgeError, StoreError
from meshforge.publish.outbox import enqueue
from meshforge.publish.typed import addressed
from meshforge.store.base import Store

RESERVE = "cmd.default.shop.inventory.reserve"
NOTED = "evt.default.shop.notes.noted"
StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class OrderRequest(msgspec.Struct):
    """``POST /orders``: the table's CHECK refuses a ``qty`` not above 0 (and rolls back)."""

    order_id: str
    sku: str
    qty: int


class NoteRequest(msgspec.Struct):
    """``POST /notes``."""

    text: str


def create_tables(store: Store) -> None:
    """The app's own table, in the same database as MeshForge's outbox."""
    with store.transaction() as tx:
        tx.execute(
            "CREATE TABLE IF NOT EXISTS shop_orders ("
            " order_id TEXT PRIMARY KEY, sku TEXT NOT NULL, qty INTEGER NOT NULL CHECK (qty > 0))"
        )


def place_order(store: Store, settings: Settings, order: OrderRequest) -> int:
    """Store the order and its reserve command together; returns the outbox row id."""
    subject, command = addressed(
        InventoryAgent,
        ReserveStock(order.order_id, order.sku, order.qty),
        settings,
        namespace="shop",  # RESERVE
        idempotency_key=f"reserve-{order.order_id}",  # a retried request is one command
        source="shop-web",
    )
    with store.transaction() as tx:  # one transaction: the order row and the message
        tx.execute(
            "INSERT INTO shop_orders (order_id, sku, qty) VALUES (?, ?, ?)",
            (order.order_id, order.sku, order.qty),
        )
        return enqueue(tx, subject, command)


def make_app(
    store: Store, publisher: SyncPublisher
) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    """The WSGI application."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "")
        try:
            size = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(size) or b"{}"
            if method == "POST" and path == "/orders":
                order = msgspec.json.decode(body, type=OrderRequest)
                row = place_order(store, publisher.settings, order)
                return _reply(start_response, "201 Created", {"outbox_id": row})
            if method == "POST" and path == "/notes":
                note = msgspec.json.decode(body, type=NoteRequest)
                result = publisher.publish(NOTED, {"text": note.text})
                return _reply(start_response, "201 Created", {"seq": result.seq})
            return _reply(start_response, "404 Not Found", {"error": f"no route {method} {path}"})
        except StoreError as exc:  # the transaction rolled back: no order, no message
            status = "409 Conflict" if exc.kind == "duplicate" else "400 Bad Request"
            return _reply(start_response, status, {"error": str(exc)})
        except (msgspec.DecodeError, ValueError) as exc:  # the body does not fit the type
            return _reply(start_response, "400 Bad Request", {"error": f"bad request: {exc}"})
        except MeshForgeError as exc:
            return _reply(start_response, "503 Service Unavailable", {"error": str(exc)})

    return app


def _reply(start_response: StartResponse, status: str, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode()
    start_response(
        status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
    )
    return [data]


if __name__ == "__main__":
    from wsgiref.simple_server import make_server

    from meshforge import load_settings, open_store

    settings = load_settings()
    shop_store = open_store(settings.store_url)
    create_tables(shop_store)
    with SyncPublisher(settings) as shop_publisher:
        make_server("127.0.0.1", 8000, make_app(shop_store, shop_publisher)).serve_forever()
