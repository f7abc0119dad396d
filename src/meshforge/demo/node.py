"""The demo node, ``meshforge.demo:DemoNode``: ``echo``, ``sleep`` and ``restart``.

Example::

    meshforge node lab1 node7                      # runs DemoNode
    meshforge ctl send lab1 node7 echo '{"hello": "world"}' --wait 5
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from meshforge.control.node import CommandContext, Node, command
from meshforge.errors import Unrecoverable

__all__ = ["DemoNode"]

# A sleep longer than this is refused: a demo command should not hold a node for hours.
MAX_SLEEP = 3600.0


class DemoNode(Node):
    """``echo`` replies with its payload; ``sleep {"seconds"}`` waits (kept alive by
    in-progress acks); ``restart`` is a simulated restart that bumps the epoch."""

    @command()
    async def echo(self, payload: dict[str, Any], ctx: CommandContext) -> Any:
        return payload

    @command()
    async def sleep(self, payload: dict[str, Any], ctx: CommandContext) -> Any:
        seconds = payload.get("seconds", 1)
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not math.isfinite(seconds)
            or not 0 <= seconds <= MAX_SLEEP
        ):
            raise Unrecoverable(
                f"sleep: 'seconds' must be a number from 0 to {MAX_SLEEP:g}, got {seconds!r}"
            )
        await asyncio.sleep(seconds)  # the command's work is to wait
        return {"slept": seconds}

    @command()
    async def restart(self, payload: dict[str, Any], ctx: CommandContext) -> Any:
        ctx.restart()
        return {"restarted": True, "previous_epoch": ctx.epoch}
