"""Key-value buckets: the one way MeshForge opens a bucket, creating it when it may.

Presence, jobs and partition ownership each keep a bucket that the first process to need
it creates; several processes starting together race to create it, and the loser must get
the winner's bucket, not an error.

Example::

    config = KeyValueConfig(bucket="MESHFORGE_JOBS", history=1)
    kv = await key_value(conn.js, config, create=True)
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import APIError, BucketNotFoundError
from nats.js.kv import KeyValue

__all__ = ["key_value"]


async def key_value(
    js: JetStreamContext, config: KeyValueConfig, *, create: bool = True
) -> KeyValue | None:
    """The bucket ``config.bucket``; created from ``config`` when it is missing and
    ``create`` (else None). A bucket created by another process between the look and the
    create is returned as it is."""
    try:
        return await js.key_value(config.bucket)
    except BucketNotFoundError:
        if not create:
            return None
    try:
        return await js.create_key_value(config)
    except APIError as exc:  # created just now with another config (the same one succeeds)
        try:
            return await js.key_value(config.bucket)
        except BucketNotFoundError:
            raise exc from None
