"""Shared pieces of the outage tests: a store that fills its disk, a private PostgreSQL,
and what every outage must end with (each command applied once, no dead letter).

(No tests here.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import psycopg
import pytest
from test_engine_support import consumer_idle, dead_letters_of, events_of, wait_until

from meshforge.envelope import Envelope
from meshforge.runtime import Agent, Event, Output, command
from meshforge.transport.connection import Connection


class Count(msgspec.Struct):
    n: int = 0


def blob_agent() -> Agent[Count]:
    """An agent with a unique name whose ``put {"id", "pad"}`` stores its pad twice (the
    event and the effect's outputs): a few commands fill a small disk."""

    class Blob(Agent[Count]):
        name = f"blob{uuid.uuid4().hex[:8]}"

        @command("put", key="id")
        def put(self, cmd: Envelope, state: Count) -> list[Output]:
            return [Event("stored", {"id": cmd.payload["id"], "pad": cmd.payload.get("pad", "")})]

        def apply(self, state: Count, event: Event) -> Count:
            return Count(state.n + 1)

    return Blob()


@contextlib.contextmanager
def small_disk(path: Path, size: str = "4m") -> Iterator[Path]:
    """A tmpfs of ``size`` at ``path`` (needs root), unmounted at the end."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """Write a ballast file until the disk is full; returns it (delete it to free the disk)."""
    ballast = disk / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (65536, 4096, 512, 1):  # down to the last bytes
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
    finally:
        os.close(fd)
    return ballast


async def all_applied_once(
    conn: Connection, agent: str, ids: list[str], within: float = 60.0
) -> None:
    """Every command of ``ids`` has exactly one event, nothing is dead-lettered, the
    consumer is idle."""

    async def settled() -> bool:
        if await dead_letters_of(conn, agent):
            return True  # failed: said below
        return len(await events_of(conn, agent)) >= len(ids) and await consumer_idle(conn, agent)

    await wait_until(settled, within=within, what=f"{len(ids)} commands applied")
    letters = await dead_letters_of(conn, agent)
    assert letters == [], f"{len(letters)} dead-lettered: {letters[0].headers.get('Dlq-Error')}"
    causes = [m.envelope().causation_id for m in await events_of(conn, agent)]
    assert sorted(c for c in causes if c) == sorted(ids), (
        f"applied: {len(causes)} events for {len(ids)} commands"
    )


def outage_lines(records: list[logging.LogRecord]) -> dict[str, int]:
    """How many lines of each level MeshForge logged (the outage must not flood the log)."""
    counts: dict[str, int] = {}
    for r in records:
        if r.name.startswith("meshforge"):
            counts[r.levelname] = counts.get(r.levelname, 0) + 1
    return counts


def switch_lines(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage().split(":")[0] for r in records if r.name == "meshforge.killswitch"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivatePostgres:
    """A PostgreSQL cluster of the test's own (``initdb`` + ``pg_ctl`` as user postgres),
    on a free port in ``root``: stopped and started as its operator would, never the
    machine's server on 5432."""

    def __init__(self) -> None:
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
        if not found:
            pytest.fail("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
        self.bin = found[-1].parent
        # Not under pytest's tmp_path: user postgres cannot enter root's private directory.
        self.root = Path(tempfile.mkdtemp(prefix="meshforge-pg-"))
        self.data = self.root / "data"
        self.port = free_port()

    def _as_postgres(self, *args: str) -> None:
        cmd = [str(self.bin / args[0]), *args[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode:
            raise AssertionError(f"{args[0]} failed: {done.stderr.strip() or done.stdout.strip()}")

    def init(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self._as_postgres(
            "initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync"
        )
        # PostgreSQL takes no port 0 and restarts keep the port, so it is picked here; another
        # process may bind it first, and the first start then tries another (twice at most).
        for retries in (2, 1, 0):
            logged = self._log_size()
            try:
                self.start()
                return
            except AssertionError:
                if not retries or "Address already in use" not in self._log_since(logged):
                    raise
                self.port = free_port()

    def _log_size(self) -> int:
        log = self.root / "log"
        return log.stat().st_size if log.exists() else 0

    def _log_since(self, offset: int) -> str:
        with contextlib.suppress(OSError), (self.root / "log").open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")
        return ""

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._as_postgres(
            "pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-w", "start"
        )

    def stop(self, mode: str = "immediate") -> None:
        self._as_postgres("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        """Stop it (if running) and delete its files."""
        with contextlib.suppress(AssertionError):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def read_only(self, on: bool) -> None:
        """Every session's next transaction is read-only (or writable again)."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(
                f"ALTER SYSTEM SET default_transaction_read_only = {'on' if on else 'off'}"
            )
            conn.execute("SELECT pg_reload_conf()")
