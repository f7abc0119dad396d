"""Helpers for the dead-letter tests."""

from __future__ import annotations

import uuid

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from meshforge.topology.subjects import STREAM_COMMANDS


async def take(js: JetStreamContext, subject: str) -> Msg:
    """The next command on ``subject``, acked (as an agent that dead-letters it would; the
    work queue then deletes it)."""
    durable = f"t{uuid.uuid4().hex[:8]}"
    sub = await js.pull_subscribe(subject, durable=durable, stream=STREAM_COMMANDS)
    try:
        [msg] = await sub.fetch(1, timeout=5)
        await msg.ack_sync()
    finally:
        await sub.unsubscribe()
        await js.delete_consumer(STREAM_COMMANDS, durable)
    return msg
