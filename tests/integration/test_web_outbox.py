"""A real WSGI server writes orders and their commands in one transaction; ``meshforge relay``
(and ``meshforge run --relay``) publishes the outbox; SyncPublisher serves the requests too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import ops_support
import pytest

from meshforge import SyncPublisher
from meshforge.config import Settings
from meshforge.envelope import decode
from meshforge.store.base import Store
from meshforge.topology.subjects import STREAM_COMMANDS, STREAM_EVENTS
from meshforge.transport.connection import Connection
from polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import wsgi_outbox  # noqa: E402  (the example the recipe documents)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def web(meshforge_store: Store, meshforge_settings: Settings) -> Iterator[str]:
    """The example app on a real WSGI server in a thread; yields its base URL."""
    wsgi_outbox.create_tables(meshforge_store)
    publisher = SyncPublisher(meshforge_settings)
    app = wsgi_outbox.make_app(meshforge_store, publisher)
    server: WSGIServer = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(10)
    server.server_close()
    publisher.close()


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def stored(conn: Connection, stream: str, subject: str) -> list[Any]:
    found, seq = [], 1
    while True:
        try:
            raw = await conn.js.get_msg(stream, seq=seq, subject=subject, next=True)
        except Exception:  # nothing at or after seq
            return found
        found.append(decode(raw.data or b"", raw.headers or {}))
        seq = (raw.seq or seq) + 1


def _pythonpath() -> str:
    return f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests' / 'integration'}"


def start(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_")}
    env["PYTHONPATH"] = _pythonpath()
    return subprocess.Popen([sys.executable, "-m", "meshforge", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


async def test_requests_write_orders_and_commands_together_and_the_relay_sends_them_once(
    web: str, meshforge_connection: Connection, meshforge_settings: Settings,
    meshforge_store_url: str, tmp_path: Path,
) -> None:  # fmt: skip
    for n in range(5):
        status, body = post(f"{web}/orders", {"order_id": f"o-{n}", "sku": "A-1", "qty": n + 1})
        assert status == 201 and body["outbox_id"] > 0
    # Rolled back with the failed insert: no order, no message.
    assert post(f"{web}/orders", {"order_id": "o-0", "sku": "A-1", "qty": 1})[0] == 409
    assert post(f"{web}/orders", {"order_id": "o-9", "sku": "A-1", "qty": 0})[0] == 400
    assert post(f"{web}/orders", {"order_id": "o-8"})[0] == 400
    status, body = post(f"{web}/notes", {"text": "hello"})
    assert status == 201 and body["seq"] > 0
    [note] = await stored(meshforge_connection, STREAM_EVENTS, wsgi_outbox.NOTED)
    assert note.payload == {"text": "hello"} and note.type == "notes.noted"
    assert await stored(meshforge_connection, STREAM_COMMANDS, wsgi_outbox.RESERVE) == []

    # Port 0 and the port read from the relay's log: one picked here could be taken first.
    relay = ops_support.Child(
        ["relay", "--store", meshforge_store_url, "--nats-url", meshforge_settings.nats_url or "",
         "--idle", "0.1", "--metrics-port", "0"],
        tmp_path / "relay.log", env={"PYTHONPATH": _pythonpath()},
    )  # fmt: skip
    try:
        port = await relay.metrics_port()

        async def five() -> bool:
            return (
                len(await stored(meshforge_connection, STREAM_COMMANDS, wsgi_outbox.RESERVE)) >= 5
            )

        await wait_until(five, timeout=20, what="the relay to publish 5 commands")
        # The relay has the same health and metrics endpoint as a worker or a node.
        assert (
            ops_support.status(port, "/readyz") == 200
            and ops_support.status(port, "/healthz") == 200
        )
        published = ops_support.scrape(port)["meshforge_published_total"]
        assert sum(published.values()) >= 5 and "meshforge_outbox_depth" in ops_support.scrape(port)
        # A request after the relay started is sent too.
        assert post(f"{web}/orders", {"order_id": "o-5", "sku": "B-2", "qty": 1})[0] == 201

        async def six() -> bool:
            return (
                len(await stored(meshforge_connection, STREAM_COMMANDS, wsgi_outbox.RESERVE)) >= 6
            )

        await wait_until(six, timeout=20, what="the sixth command")
    finally:
        code = relay.stop(30)
    err = relay.output()
    assert code == 0, err
    assert "6 message(s) sent" in err
    commands = await stored(meshforge_connection, STREAM_COMMANDS, wsgi_outbox.RESERVE)
    assert sorted(c.payload["order_id"] for c in commands) == [f"o-{n}" for n in range(6)]
    assert all(
        c.type == "inventory.reserve" and c.key == f"reserve-{c.payload['order_id']}"
        for c in commands
    )


async def test_run_with_relay_sends_the_outbox_beside_the_agents(
    web: str, meshforge_connection: Connection, meshforge_settings: Settings,
    meshforge_store_url: str,
) -> None:  # fmt: skip
    assert post(f"{web}/orders", {"order_id": "o-1", "sku": "A-1", "qty": 2})[0] == 201
    worker = start("run", "meshforge.demo:InventoryAgent", "--relay", "--store", meshforge_store_url,
                   "--nats-url", meshforge_settings.nats_url or "")  # fmt: skip
    try:
        # The relay sends the reserve; the inventory agent (same process) answers it.
        async def answered() -> bool:
            return bool(
                await stored(
                    meshforge_connection, STREAM_EVENTS, "evt.default.shop.inventory.rejected"
                )
            )

        await wait_until(answered, timeout=30, what="inventory.rejected from the relayed command")
    finally:
        code, err = stop(worker)
    assert code == 0, err
    [rejected] = await stored(
        meshforge_connection, STREAM_EVENTS, "evt.default.shop.inventory.rejected"
    )
    assert rejected.payload["order_id"] == "o-1" and rejected.payload["reason"] == "unknown sku"
