"""Helpers for the consumer chaos tests: settings without the environment, polling."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from meshforge.config import Settings, load_settings


def settings(**values: object) -> Settings:
    """Settings from these values and defaults only (no environment, no file)."""
    return load_settings(values, env={})


async def wait_until(
    check: Callable[[], bool | Awaitable[bool]],
    timeout: float = 10.0,  # noqa: ASYNC109
    what: str = "condition",
) -> None:
    """Poll ``check`` until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(delay)  # polling with a deadline
        delay = min(delay * 2, 0.1)
