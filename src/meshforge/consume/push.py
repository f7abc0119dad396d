"""Push delivery: a durable push consumer with a deliver (queue) group, manual acks.

The server pushes to ``_meshforge.push.<stream>.<durable>``; every member of the
deliver group subscribes to it with the group as queue, so each message goes to one
member. ``max_ack_pending`` (= the consumer's concurrency) bounds what the server hands
out before acks come back; a member never runs more handlers than its concurrency, and
what waits in its buffer meanwhile is bounded by that limit too.

Example::

    subject, group = await ensure_push_consumer(conn.js, spec, group="workers",
                                                max_ack_pending=8, provision=True)
    sub = await conn.nc.subscribe(subject, queue=group, cb=on_message)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nats.js.errors import NotFoundError

from meshforge.errors import MissingTopology, TopologyError

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from meshforge.topology.specs import ConsumerSpec

__all__ = ["deliver_subject", "ensure_push_consumer"]


def deliver_subject(stream: str, durable: str) -> str:
    """Where the server pushes a durable's messages; outside every MeshForge stream.

    >>> deliver_subject("MESHFORGE_COMMANDS", "order_consumer")
    '_meshforge.push.MESHFORGE_COMMANDS.order_consumer'
    """
    return f"_meshforge.push.{stream}.{durable}"


async def ensure_push_consumer(
    js: JetStreamContext,
    spec: ConsumerSpec,
    *,
    group: str,
    max_ack_pending: int,
    provision: bool,
) -> tuple[str, str]:
    """Find (or, with ``provision``, create) the push consumer; return (deliver subject, group).

    Raises ``MissingTopology`` when it is absent and may not be created, and
    ``TopologyError`` when a consumer of that name exists but is a pull consumer or has
    another deliver group.
    """
    try:
        info = await js.consumer_info(spec.stream, spec.durable)
    except NotFoundError:
        if not provision:
            raise MissingTopology(
                f"missing JetStream topology: consumer {spec.name}; run `meshforge provision` "
                "with an account allowed to create it"
            ) from None
        config = spec.config()
        config.deliver_subject = deliver_subject(spec.stream, spec.durable)
        config.deliver_group = group
        config.max_ack_pending = max_ack_pending
        try:
            info = await js.add_consumer(spec.stream, config)
        except NotFoundError:
            raise MissingTopology(
                f"missing JetStream topology: stream {spec.stream} for push consumer {spec.durable}"
            ) from None
    subject = info.config.deliver_subject
    if not subject:
        raise TopologyError(
            f"consumer {spec.name} is a pull consumer; push mode needs a push consumer "
            "(use another durable name, or mode='pull')"
        )
    existing = info.config.deliver_group or ""
    if existing != group:
        raise TopologyError(
            f"consumer {spec.name} delivers to group {existing or '(none)'!r}, not {group!r}"
        )
    return subject, group
