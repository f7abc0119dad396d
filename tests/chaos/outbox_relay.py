"""A relay process for the outbox kill test: publishes a store's outbox until it is empty.

Usage: python outbox_relay.py STORE_URL NATS_URL PROGRESS_FILE [BATCH] [LEASE]

After every batch it appends ``<sent> <duplicates>`` to PROGRESS_FILE (flushed), so a
process killed with SIGKILL leaves what it did behind. Exits 0 once nothing is due.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from meshforge.config import load_settings
from meshforge.ops.observability import Metrics
from meshforge.publish.outbox import OutboxRelay
from meshforge.publish.publisher import Publisher
from meshforge.store import open_store
from meshforge.topology.subjects import STREAM_EVENTS
from meshforge.transport.connection import connect


async def main(store_url: str, nats_url: str, out: TextIO, batch: int, lease: float) -> None:
    settings = load_settings({}, env={})
    store = open_store(store_url)
    metrics = Metrics()
    async with await connect(settings, url=nats_url, name="outbox-chaos") as conn:
        relay = OutboxRelay(
            store, Publisher(conn.js, settings, metrics), batch_size=batch, lease_seconds=lease
        )
        duplicates = metrics.publish_duplicates.labels(stream=STREAM_EVENTS)
        while True:
            before = duplicates._value.get()
            sent = await relay.run_once()
            out.write(f"{sent} {int(duplicates._value.get() - before)}\n")
            if sent == 0 and await relay.depth() == 0:
                break
            if sent == 0:
                await asyncio.sleep(0.05)  # rows leased by a killed relay: wait for the lease
    store.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    with open(args[2], "a", buffering=1) as progress:  # line-buffered: survives SIGKILL
        asyncio.run(
            main(
                args[0],
                args[1],
                progress,
                int(args[3]) if len(args) > 3 else 100,
                float(args[4]) if len(args) > 4 else 1.0,
            )
        )
