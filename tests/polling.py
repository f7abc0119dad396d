"""Waiting for a condition with a deadline: the one way tests synchronise on the outside world."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def wait_until(
    check: Callable[[], bool | Awaitable[bool]],
    timeout: float = 10.0,  # noqa: ASYNC109
    what: str = "condition",
) -> None:
    """Poll ``check`` (sync or async) until true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(delay)  # polling with a deadline
        delay = min(delay * 2, 0.1)


def wait_until_sync(
    check: Callable[[], bool], timeout: float = 60.0, what: str = "condition"
) -> None:
    """``wait_until`` for code outside an event loop."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(delay)  # polling with a deadline
        delay = min(delay * 2, 0.5)
