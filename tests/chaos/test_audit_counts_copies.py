"""The crash audit counts every output message: an output stored twice in the events
stream (published again after the duplicate window, e.g. by a worker paused for minutes
between publish and ack) is a violation, though the set of ids looks complete."""

from __future__ import annotations

import pytest
from crash_harness import audit_events

from meshforge.cli.demo_support import StreamMessage, read_stream
from meshforge.config import load_settings
from meshforge.envelope import Envelope
from meshforge.publish.publisher import Publisher
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_EVENTS
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer
from polling import wait_until


async def test_an_output_published_again_after_the_duplicate_window_fails_the_audit(
    private_server: EmbeddedServer,
) -> None:
    # A short duplicate window stands in for a pause of minutes.
    settings = load_settings({"nats_url": private_server.url, "duplicate_window": 0.2}, env={})
    conn = await connect(settings, name="audit-copies")
    try:
        await ensure(conn.js, default_streams(settings))
        publisher = Publisher(conn.js, settings)
        create = Envelope.new("order.create", {"sku": "SKU0", "qty": 1})
        stock = Envelope.new("inventory.create", {"sku": "SKU0", "qty": 5})
        reserve = create.child("inventory.reserve", {"sku": "SKU0", "qty": 1}, 1)
        created = create.child("order.created", {"sku": "SKU0"}, 0)
        outputs = [("evt.default.demo.order.created", created),
                   ("evt.default.demo.inventory.reserved", reserve.child("inventory.reserved", {}, 0)),
                   ("evt.default.demo.inventory.created", stock.child("inventory.created", {}, 0))]  # fmt: skip
        for subject, env in outputs:
            await publisher.publish(subject, env)

        async def events() -> list[StreamMessage]:
            return await read_stream(conn.js, STREAM_EVENTS, "evt.>")

        assert audit_events(await events(), [create], [stock]) == {e.id for _, e in outputs}

        async def stored_again() -> bool:
            result = await publisher.publish("evt.default.demo.order.created", created)
            return not result.duplicate  # inside the window the server drops it

        await wait_until(
            stored_again, timeout=10, what="the re-publish stored after the duplicate window"
        )
        doubled = await events()
        # What the audit compared before: the set of ids, complete and blind to the copy.
        assert len({m.headers["Nats-Msg-Id"] for m in doubled}) == 3 and len(doubled) == 4
        with pytest.raises(AssertionError, match=f"stored more than once.*'{created.id}': 2"):
            audit_events(doubled, [create], [stock])
    finally:
        await conn.close()
