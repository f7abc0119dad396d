"""Health endpoints of `meshforge run` and `meshforge node`: readiness follows the NATS
connection, the endpoint listens on 127.0.0.1 unless told otherwise, a port in use is one line."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from pathlib import Path

import pytest
from ops_support import Child, http_get, scrape, status
from test_engine_support import running, settings_for

from meshforge.cli.demo_support import meshforge_command
from meshforge.demo import OrderAgent
from meshforge.transport.server import EmbeddedServer
from polling import wait_until


async def _status(port: int, path: str) -> int:
    return await asyncio.to_thread(status, port, path)


async def _follow_the_server(server: EmbeddedServer, port: int) -> None:
    """/readyz: 200, then 503 while the server is down, then 200 once it is back."""
    await wait_until(lambda: _is(port, "/readyz", 200), 30, "ready before the kill")
    await asyncio.to_thread(server.kill)
    await wait_until(lambda: _is(port, "/readyz", 503), 20, "/readyz 503 with NATS down")
    assert await _status(port, "/healthz") == 503
    ready = (await asyncio.to_thread(scrape, port))["meshforge_ready"]
    assert ready == {(): 0.0}
    await asyncio.to_thread(server.start)
    await wait_until(lambda: _is(port, "/readyz", 200), 30, "/readyz 200 after the restart")
    assert await _status(port, "/healthz") == 200


async def _is(port: int, path: str, code: int) -> bool:
    return await _status(port, path) == code


async def test_run_readyz_is_503_while_nats_is_disconnected(
    private_server: EmbeddedServer, sqlite_url: str
) -> None:
    settings = settings_for(private_server.url, sqlite_url, metrics_port=0)
    async with running([OrderAgent()], settings) as worker:
        assert worker.endpoint is not None
        assert worker.endpoint.host == "127.0.0.1"  # the safe default: not every interface
        await _follow_the_server(private_server, worker.endpoint.port)


async def test_node_readyz_is_503_while_nats_is_disconnected(
    private_server: EmbeddedServer, tmp_path: Path
) -> None:
    node = Child(
        ["node", "lab1", "n1", "--store", f"sqlite:///{tmp_path / 'node.db'}",
         "--nats-url", private_server.url, "--metrics-port", "0", "--presence-interval", "1"],
        tmp_path / "node.log",
    )  # fmt: skip
    try:
        port = await node.metrics_port()
        await _follow_the_server(private_server, port)
        code, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/healthz")
        report = json.loads(body)
        assert code == 200 and (report["site"], report["node"], report["epoch"]) == (
            "lab1",
            "n1",
            1,
        )
    finally:
        assert node.stop() == 0, node.output()


@pytest.mark.parametrize("command", ["run", "node"])
def test_metrics_port_in_use_is_one_line(command: str, nats_url: str, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        target = ["meshforge.demo:OrderAgent"] if command == "run" else ["lab1", "busy"]
        done = subprocess.run(
            meshforge_command(command, *target, "--metrics-port", str(port), "--nats-url", nats_url,
                              "--store", f"sqlite:///{tmp_path / 'store.db'}"),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"error: cannot serve /healthz /readyz /metrics on 127.0.0.1:{port}: in use; "
        "choose another --metrics-port (0 picks a free one)"
    ], done.stderr


async def test_metrics_host_binds_the_address_given(nats_url: str, sqlite_url: str) -> None:
    settings = settings_for(nats_url, sqlite_url, metrics_port=0, metrics_host="0.0.0.0")
    async with running([OrderAgent()], settings) as worker:
        assert worker.endpoint is not None and worker.endpoint.host == "0.0.0.0"
        assert await _status(worker.endpoint.port, "/readyz") == 200
