"""The engine's publish stage: committed outputs leave in commit order while the next
group of commands commits.

Each committed group becomes one job; a job publishes only after the job before it
finished, so a resource's outputs reach the stream in the order its commands were
applied even though the store is already working on later commands. A job that cannot
publish tells its caller (the commands are nak'ed, and their redelivery re-publishes the
stored outputs); it never stops the jobs after it.

Example (what ``Engine`` does after each commit)::

    stage = PublishStage("order_consumer", publisher)
    stage.submit(items, on_sent=mark, on_failed=nak_all, settle=[future])
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from meshforge.consume.decisions import Action
from meshforge.consume.policy import Cause, FailurePolicy, Outcome
from meshforge.errors import PublishError
from meshforge.ops.faults import crash_point
from meshforge.publish.publisher import Message, Publisher
from meshforge.runtime.killswitch import KillSwitch

__all__ = ["PublishStage"]

log = logging.getLogger("meshforge.engine")

_SPLIT_AT = 8  # outputs in a group from which it is published in two halves
# Whether a failed publish waits for the server (its rules need no consumer's settings).
_POLICY = FailurePolicy()


class PublishStage:
    """A FIFO of publish jobs, one per committed group. Its items are the engine's outputs,
    each checked against the publisher's size limits before it was stored."""

    def __init__(
        self, consumer: str, publisher: Publisher, kill_switch: KillSwitch | None = None
    ) -> None:
        self.consumer = consumer
        self.publisher = publisher
        #: Given one, a job the server cannot take (it is away, or fails every publish)
        #: waits for it with the switch open instead of failing its commands.
        self.kill_switch = kill_switch
        self._tail: asyncio.Future[None] | None = None

    @property
    def busy(self) -> bool:
        """A job is still publishing (or waiting for its turn)."""
        return self._tail is not None and not self._tail.done()

    def submit(
        self,
        items: Sequence[Message],
        *,
        on_sent: Callable[[], None],
        on_failed: Callable[[], None],
        settle: Sequence[asyncio.Future[None]],
    ) -> None:
        """Publish ``items`` after every job submitted before; then call ``on_sent`` (or
        ``on_failed``) and resolve the ``settle`` futures."""
        self._tail = asyncio.ensure_future(self._job(self._tail, items, on_sent, on_failed, settle))

    async def wait(self) -> None:
        """Until every job submitted so far has finished."""
        if self._tail is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._tail)

    async def _job(
        self,
        before: asyncio.Future[None] | None,
        items: Sequence[Message],
        on_sent: Callable[[], None],
        on_failed: Callable[[], None],
        settle: Sequence[asyncio.Future[None]],
    ) -> None:
        try:
            if before is not None:
                with contextlib.suppress(Exception):  # its own failure was handled there
                    await before
            crash_point("before_publish")
            if await self._publish(items):
                on_sent()
            else:
                on_failed()
            crash_point("after_publish")
        except BaseException as exc:
            for fut in settle:
                if not fut.done():
                    fut.cancel() if isinstance(exc, asyncio.CancelledError) else fut.set_exception(
                        exc
                    )
            if not isinstance(exc, Exception):
                raise
            log.error("%s: publish stage failed", self.consumer, exc_info=exc)
        finally:
            for fut in settle:
                if not fut.done():
                    fut.set_result(None)

    async def _publish(self, items: Sequence[Message]) -> bool:
        """Publish every item; False when some did not go."""
        if not items:
            return True
        # A small group goes in one round trip (latency); a large one in two halves, the
        # crash suite's view of a group caught half published.
        half = len(items) // 2 if len(items) >= _SPLIT_AT else len(items)
        # The engine measured every output against the limits before storing it.
        probes = 0
        while True:
            try:
                await self.publisher.publish_many(items[:half], checked=True)
                crash_point("after_partial_publish")
                if items[half:]:
                    await self.publisher.publish_many(items[half:], checked=True)
            except PublishError as exc:
                wait = (
                    _POLICY.decide(Outcome(Cause.PUBLISH, error=exc)).action is Action.IN_PROGRESS
                )
                if self.kill_switch is None or not wait:
                    log.warning(
                        "%s: publishing outputs failed, batch will be redelivered: %s",
                        self.consumer,
                        exc,
                    )
                    return False
                # Every output would fail alike: hold them (sent again, deduplicated, later).
                self.kill_switch.open("server", exc)
                probes += 1
                await self.kill_switch.pause(probes)
                continue
            if self.kill_switch is not None:
                self.kill_switch.close("server")
            return True
