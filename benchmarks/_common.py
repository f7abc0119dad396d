"""Shared bits of the benchmark scripts: an embedded server, timing and the ratio table."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()

BODY_SIZE = 128


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


def report(title: str, n: int, rows: list[tuple[str, float]], baseline: str) -> dict[str, float]:
    """Print rate per row and its ratio to ``baseline``; return rates by name."""
    rates = {name: n / seconds for name, seconds in rows}
    base = rates[baseline]
    table = Table(title=f"{title}: {n:,} messages ({machine()})")
    table.add_column("variant")
    table.add_column("msgs/s", justify="right")
    table.add_column(f"vs {baseline}", justify="right")
    for name, _ in rows:
        table.add_row(name, f"{rates[name]:,.0f}", f"{rates[name] / base:.2f}x")
    console.print(table)
    return rates
