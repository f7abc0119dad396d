"""Helpers for the operations tests: HTTP probes, scraping, meshforge child processes."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from meshforge.cli.demo_support import meshforge_command

# What a worker, node or relay logs once its endpoint is bound: the port it took.
_METRICS_ON = re.compile(r"metrics on (?:http://)?[^\s:]+:(\d+)")


def http_get(url: str) -> tuple[int, bytes]:
    """Status and body; connection refused is status 0."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def status(port: int, path: str) -> int:
    return http_get(f"http://127.0.0.1:{port}{path}")[0]


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every exported sample name -> {sorted labels: value} (families with no sample: {})."""
    code, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert code == 200, f"/metrics answered {code}"
    return parse_metrics(body.decode())


def parse_metrics(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        # A family declared but without samples yet still counts as exported.
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
        for suffix in suffixes.get(family.type, ("",)):
            out.setdefault(family.name + suffix, {})
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


class Child:
    """``meshforge ARGS`` as a child process, output in ``log``."""

    def __init__(
        self, args: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.log = log
        environ = {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_")}
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                meshforge_command(*args), stdout=out, stderr=subprocess.STDOUT,
                env={**environ, **(env or {})}, start_new_session=True,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def metrics_port(self, timeout: float = 30.0) -> int:  # noqa: ASYNC109
        """The port of a child started with ``--metrics-port 0``, read from its log (a port
        picked here and released would race another process for it)."""
        deadline = time.monotonic() + timeout
        while (found := _METRICS_ON.search(self.output())) is None:
            assert self.proc.poll() is None, f"the child exited: {self.output()[-2000:]}"
            assert time.monotonic() < deadline, f"no 'metrics on' line: {self.output()[-2000:]}"
            await asyncio.sleep(0.05)  # polling the child's log with a deadline
        return int(found.group(1))

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
