"""Hostile header blocks through a real server: the runtime's client and the Spark data source
(both of its ways to read a stream) make the same of each (tests/header_table.py).

Core NATS hands a subscriber each block as it was sent; JetStream stores it without an
inline status line (the server drops those), so stored blocks are compared reader to
reader, and with the table where the server kept the block as it was."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from header_table import HOSTILE
from meshforge.spark.fetch import read_range
from meshforge.spark.nats_sync import ConnOptions, SyncNats
from meshforge.transport.connection import Connection
from polling import wait_until

STREAM = "HDRRULES"


async def test_the_runtime_and_spark_read_every_hostile_block_alike(
    meshforge_connection: Connection, meshforge_url: str
) -> None:
    nc = meshforge_connection.nc
    js = meshforge_connection.js
    await js.add_stream(name=STREAM, subjects=["hdrrules.>"], storage="memory")
    queued: dict[str, dict[str, str] | None] = {}
    direct: dict[str, dict[str, str] | None] = {}

    async def on_msg(msg: Msg) -> None:
        queued[msg.subject] = msg.headers

    await nc.subscribe("hdrrules.>", cb=on_msg)
    sub = await nc.subscribe("hdrrules.>")
    nc.deliver_direct(sub._id, lambda msg: direct.__setitem__(msg.subject, msg.headers))
    try:
        # each block exactly as written, as another client (or an attacker) could send it
        commands = b"".join(
            b"HPUB hdrrules.%d %d %d\r\n%s{}\r\n" % (i, len(block), len(block) + 2, block)
            for i, (_, block, _) in enumerate(HOSTILE)
        )
        await nc.send_now(commands)
        await wait_until(
            lambda: len(queued) == len(direct) == len(HOSTILE), what="every block, read back"
        )
        info = await js.stream_info(STREAM)
        assert info.state.messages == len(HOSTILE)

        def spark_reads(retention: str) -> dict[str, dict[str, str] | None]:
            with SyncNats(ConnOptions(servers=(meshforge_url,))) as client:
                chunks = list(read_range(client, STREAM, 1, len(HOSTILE), retention=retention))
            return {s: h for c in chunks for s, h in zip(c.subjects, c.headers, strict=True)}

        for i, (name, _, expected) in enumerate(HOSTILE):
            subject = f"hdrrules.{i}"
            assert queued[subject] == direct[subject] == expected, name

        # the stored blocks as a JetStream consumer delivers them to the runtime's client
        stored: dict[str, dict[str, str] | None] = {}

        async def on_stored(msg: Msg) -> None:
            stored[msg.subject] = msg.headers

        await nc.subscribe("hdrrules_delivered", cb=on_stored)
        await js.add_consumer(STREAM, deliver_subject="hdrrules_delivered", ack_policy="none")
        await wait_until(lambda: len(stored) == len(HOSTILE), what="every stored block, delivered")
        by_pull = await asyncio.to_thread(spark_reads, "limits")  # an ephemeral pull consumer
        by_get = await asyncio.to_thread(spark_reads, "workqueue")  # STREAM.MSG.GET, stored blocks
        for i, (name, block, expected) in enumerate(HOSTILE):
            subject = f"hdrrules.{i}"
            seen = {
                "runtime": stored[subject],
                "spark, pull": by_pull[subject],
                "spark, get": by_get[subject],
            }
            assert seen == dict.fromkeys(seen, stored[subject]), name
            if not block.startswith(b"NATS/1.0 "):  # kept as sent
                assert stored[subject] == expected, name
    finally:
        await js.delete_stream(STREAM)
