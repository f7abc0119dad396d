"""Helpers for the control-plane tests: node subprocesses, the run log, dead letters, reply counts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from meshforge.topology.subjects import STREAM_FAILED, STREAM_REPLIES

HERE = Path(__file__).resolve().parent
MESHFORGE = Path(sys.executable).parent / "meshforge"
TEST_NODE = "control_testnode:RecordingNode"


class NodeProcess:
    """``meshforge node SITE NODE control_testnode:RecordingNode`` as a child process."""

    def __init__(
        self,
        site: str,
        node: str,
        *,
        nats_url: str,
        store_url: str,
        run_log: Path,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        label: str = "node",
    ) -> None:
        self.args = [
            str(MESHFORGE), "node", site, node, TEST_NODE,
            "--store", store_url, "--nats-url", nats_url, "--presence-interval", "1",
        ]  # fmt: skip
        inherited = {k: v for k, v in os.environ.items() if k != "MESHFORGE_CRASH_AT"}
        self.env = {
            **inherited,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "MESHFORGE_TEST_RUN_LOG": str(run_log),
            "MESHFORGE_LOG_LEVEL": "INFO",
            **(env or {}),
        }
        self.log_path = log_dir / f"{label}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> NodeProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def wait_exit(self, timeout: float) -> int:  # noqa: ASYNC109
        """The exit code once the process ended (negative: killed by that signal)."""
        assert self.proc is not None
        end = time.monotonic() + timeout
        while (code := self.proc.poll()) is None:
            if time.monotonic() > end:
                raise AssertionError(f"node did not exit within {timeout}s; log:\n{self.log()}")
            await asyncio.sleep(0.05)  # polling the child's exit status
        return code

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (graceful), then SIGKILL if it does not stop in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def runs(run_log: Path) -> list[tuple[str, str, float]]:
    """(command id, command, unix time) for every recorded run."""
    if not run_log.exists():
        return []
    out = []
    for line in run_log.read_text().splitlines():
        command_id, name, at = line.split()
        out.append((command_id, name, float(at)))
    return out


async def dead_letter(
    js: JetStreamContext,
    original_subject: str,
    timeout: float = 10.0,  # noqa: ASYNC109
) -> RawStreamMsg:
    """The latest dead letter of ``original_subject``, waiting for it to appear."""
    end = time.monotonic() + timeout
    while True:
        try:
            return await js.get_last_msg(STREAM_FAILED, f"failed.{original_subject}")
        except NotFoundError:
            if time.monotonic() > end:
                raise AssertionError(
                    f"no dead letter for {original_subject} within {timeout}s"
                ) from None
            await asyncio.sleep(0.05)  # polling the stream for the dead letter


async def stored_count(js: JetStreamContext, stream: str, subject: str) -> int:
    """How many messages ``stream`` holds on ``subject``."""
    info = await js.stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


async def reply_count(js: JetStreamContext, subject: str) -> int:
    return await stored_count(js, STREAM_REPLIES, subject)
