"""Listing more consumers than nats-server puts in one page, against a real server.

tests/unit/test_provision_listing.py models the server's paging by hand; this checks the
listing code against the server itself.
"""

from __future__ import annotations

import asyncio
import uuid

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from meshforge.topology.provision import _existing_consumers
from meshforge.topology.specs import js_api

COUNT = 300  # more than the server's page of 256 consumers


async def test_every_consumer_of_a_stream_is_listed_past_the_first_page(
    js: JetStreamContext,
) -> None:
    stream = f"PAGING_{uuid.uuid4().hex[:8].upper()}"
    await js.add_stream(name=stream, subjects=[f"paging.{stream}.>"])
    try:
        names = [f"c{i:03d}" for i in range(COUNT)]
        gate = asyncio.Semaphore(32)  # a few requests at a time: quick, and no timeouts

        async def add(name: str) -> None:
            async with gate:
                await js.add_consumer(
                    stream, ConsumerConfig(durable_name=name, ack_policy=AckPolicy.EXPLICIT)
                )

        await asyncio.gather(*(add(n) for n in names))
        first = await js_api(js, f"CONSUMER.LIST.{stream}", {"offset": 0})
        assert first["total"] == COUNT
        assert 0 < len(first["consumers"]) < COUNT  # the server does page: a second page exists
        assert sorted(await _existing_consumers(js, stream)) == names
    finally:
        await js.delete_stream(stream)
