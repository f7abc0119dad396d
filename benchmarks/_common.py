"""Shared bits of the benchmark scripts: an embedded server, timing and the ratio table."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.table import Table

# Wide: a table piped into run_all.py keeps one line a row (rich falls back to 80 columns).
console = Console(width=150)

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


def _process_cpu() -> dict[int, tuple[str, float]]:
    """Every live process's command line and CPU seconds (user + system), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        found[int(entry.name)] = (cmdline, (int(fields[11]) + int(fields[12])) / ticks)
    return found


class CpuMeter:
    """CPU seconds spent by each group of processes while the block runs (Linux only).

    ``groups`` maps a name to a test on (pid, command line). A process that starts inside
    the block counts from zero; one that ends inside it is missed, so measure blocks
    whose processes outlive them (Spark reuses its Python workers).

        with CpuMeter({"nats-server": lambda pid, cmd: pid == server.pid}) as cpu:
            ...
        print(cpu.seconds)
    """

    def __init__(self, groups: dict[str, Callable[[int, str], bool]]) -> None:
        self.groups = groups
        self.seconds: dict[str, float] = {}
        self._before: dict[int, tuple[str, float]] = {}

    def __enter__(self) -> CpuMeter:
        self._before = _process_cpu() if Path("/proc/self/stat").exists() else {}
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._before:
            return
        self.seconds = dict.fromkeys(self.groups, 0.0)
        for pid, (cmdline, seconds) in _process_cpu().items():
            spent = seconds - self._before.get(pid, ("", 0.0))[1]
            for name, member in self.groups.items():
                if member(pid, cmdline):
                    self.seconds[name] += spent
                    break
