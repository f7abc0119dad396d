"""A TCP relay for a site's leaf link, to cut it and restore it (tests and the fleet demo).

Example::

    link = await LinkRelay(hub_leaf_port).start()
    site = site_server("plant3", link.url, store_dir=...)   # the site dials the relay
    await link.cut()        # the leaf connection drops; the site cannot reconnect
    await link.restore()    # it reconnects on its next attempt
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["LinkRelay"]


class LinkRelay:
    """A TCP relay for one site's leaf link: ``cut()`` drops it (and refuses new
    connections), ``restore()`` lets the site reconnect. Runs on the test's event loop."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> LinkRelay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"nats-leaf://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        self._writers -= {writer, up_writer}

    async def cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        if server is not None:
            await server.wait_closed()

    async def restore(self) -> None:
        await self.start()
