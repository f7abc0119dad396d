"""Helpers for the console's browser tests: the console as a child process, planted letters."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

from nats.js import JetStreamContext
from playwright.async_api import Page

from meshforge.envelope import Envelope, now_ts
from meshforge.topology.subjects import DEAD_LETTER_PREFIX, STREAM_FAILED

ROOT = Path(__file__).resolve().parents[2]
DOC_IMAGES = ROOT / "docs" / "img"
VIEWER_TOKEN = "viewer-" + uuid.uuid4().hex
OPERATOR_TOKEN = "operator-" + uuid.uuid4().hex
TOKENS = {
    "MESHFORGE_CONSOLE_VIEWER_TOKEN": VIEWER_TOKEN,
    "MESHFORGE_CONSOLE_OPERATOR_TOKEN": OPERATOR_TOKEN,
}
_URL = re.compile(r"meshforge console at (http://\S+)")


class ConsoleProcess:
    """``meshforge console --port 0`` as a child process; ``url`` once it listens."""

    def __init__(
        self, nats_url: str, log_dir: Path, *args: str, env: Mapping[str, str] | None = None
    ) -> None:
        self.args = [sys.executable, "-m", "meshforge", "console", "--port", "0",
                     "--nats-url", nats_url, *args]  # fmt: skip
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_CONSOLE")}
        self.env = {**inherited, "MESHFORGE_LOG_LEVEL": "INFO", **(env or {})}
        self.out = log_dir / f"console-{uuid.uuid4().hex[:6]}.out"
        self.err = self.out.with_suffix(".err")
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 30.0) -> ConsoleProcess:
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=out, stderr=err)
        end = time.monotonic() + timeout
        while not (found := _URL.search(self.out.read_text(errors="replace"))):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise AssertionError(f"the console did not start:\n{self.log()}")
            time.sleep(0.05)  # polling the child's output for its URL
        self.url = found.group(1).rstrip("/")
        return self

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in (self.out, self.err) if p.exists())

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


async def plant(
    js: JetStreamContext,
    original_subject: str,
    body: bytes,
    *,
    reason: str = "max_deliveries",
    error: str = "RuntimeError: the store was down",
    headers: Mapping[str, str] | None = None,
) -> int:
    """Store a dead letter of ``original_subject`` as the runtime writes one; returns its id."""
    stored = {
        "Nats-Msg-Id": f"planted-{uuid.uuid4().hex}",
        "Dlq-Reason": reason,
        "Dlq-Error": error,
        "Dlq-Deliveries": "5",
        "Dlq-Original-Subject": original_subject,
        "Dlq-Timestamp": now_ts(),
        **(headers or {}),
    }
    ack = await js.publish(
        DEAD_LETTER_PREFIX + original_subject, body, headers=stored, stream=STREAM_FAILED
    )
    return int(ack.seq)


def command_body(
    type_: str, payload: Mapping[str, object], tenant: str = "default"
) -> tuple[bytes, str]:
    """An envelope's body and id, as a producer would have sent it."""
    env = Envelope.new(type_, dict(payload), tenant_id=tenant, source="test")
    return env.encode(), env.id


async def sign_in(tab: Page, base: str, token: str, name: str) -> None:
    """Sign in through the login form, as a person does."""
    await tab.goto(f"{base}/")
    await tab.wait_for_url("**/login**")
    await tab.fill("input[name=name]", name)
    await tab.fill("input[name=token]", token)
    await tab.click("#sign-in")
    await tab.wait_for_selector("#who")


@contextlib.contextmanager
def node_process(
    nats_url: str, home: Path, site: str, node: str
) -> Iterator[subprocess.Popen[bytes]]:
    """``meshforge node SITE NODE`` as a child, announcing itself every second."""
    args = [sys.executable, "-m", "meshforge", "node", site, node,
            "--nats-url", nats_url, "--store", f"sqlite:///{home / 'node.db'}",
            "--presence-interval", "1"]  # fmt: skip
    with (home / "node.log").open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=home)
    try:
        yield proc
    finally:
        stop_child(proc)


def stop_child(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 15 s: a child of a test never outlives it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
