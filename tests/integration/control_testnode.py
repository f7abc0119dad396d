"""A node for the control-plane tests: the demo node, plus a log of every run outside its store.

Each run of ``echo`` or ``fail`` appends ``<command id> <command> <unix time>`` to the file
named by ``MESHFORGE_TEST_RUN_LOG``, so a test can prove a command ran once (and when),
whatever the node's own store says. Run as ``meshforge node SITE NODE control_testnode:RecordingNode``
with this directory on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from meshforge.control.node import CommandContext, command
from meshforge.demo.node import DemoNode


def _record(ctx: CommandContext) -> None:
    path = os.environ["MESHFORGE_TEST_RUN_LOG"]
    # O_APPEND single write: lines from two node processes never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{ctx.command_id} {ctx.command} {time.time():.6f}\n".encode())
    finally:
        os.close(fd)


class RecordingNode(DemoNode):
    """``echo`` and ``sleep`` record each run; ``fail`` records the attempt and raises."""

    @command()
    async def echo(self, payload: dict[str, Any], ctx: CommandContext) -> Any:
        _record(ctx)
        return payload

    @command()
    async def sleep(self, payload: dict[str, Any], ctx: CommandContext) -> Any:
        _record(ctx)
        return await super().sleep(payload, ctx)

    @command()
    async def fail(self, payload: dict[str, Any], ctx: CommandContext) -> Any:
        _record(ctx)
        raise RuntimeError("this command always fails")
