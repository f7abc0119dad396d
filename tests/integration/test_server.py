from __future__ import annotations

import socket

import nats
import pytest

from meshforge.errors import ServerError
from meshforge.server import EmbeddedServer


async def test_embedded_server_has_jetstream(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    info = await nc.jetstream().account_info()
    assert info.limits.max_streams == -1
    await nc.close()


def test_server_restarts_on_same_port_and_keeps_data(private_server: EmbeddedServer) -> None:
    import asyncio

    async def put() -> None:
        nc = await nats.connect(private_server.url)
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        await js.publish("keep.a", b"x")
        await nc.close()

    async def count() -> int:
        nc = await nats.connect(private_server.url)
        info = await nc.jetstream().stream_info("KEEP")
        await nc.close()
        return int(info.state.messages)

    asyncio.run(put())
    port = private_server.port
    private_server.kill()
    assert not private_server.running
    private_server.start()
    assert private_server.port == port
    assert asyncio.run(count()) == 1


def test_busy_port_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        server = EmbeddedServer(store_dir=tmp_path, port=port, start_timeout=5)
        with pytest.raises(ServerError, match="nats-server"):
            server.start()
        server.close()
