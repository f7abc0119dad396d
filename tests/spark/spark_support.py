"""Helpers for the Spark tests: publishing with plain nats-py, reading results back."""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext


async def publish_many(
    js: JetStreamContext, subject: str, count: int, *, start: int = 0, headers: bool = True
) -> None:
    """Publish ``count`` small JSON bodies ``{"i": n}`` with headers, in flight together."""
    futures = [
        js.publish(
            subject,
            b'{"i":%d}' % i,
            headers={"Nats-Msg-Id": f"m-{subject}-{i}", "X-Index": str(i)} if headers else None,
        )
        for i in range(start, start + count)
    ]
    for i in range(0, len(futures), 500):
        await asyncio.gather(*futures[i : i + 500])
