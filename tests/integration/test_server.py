from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from meshforge.errors import ServerError
from meshforge.transport.server import EmbeddedServer
from polling import wait_until_sync


async def test_embedded_server_has_jetstream(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    info = await nc.jetstream().account_info()
    assert info.limits.max_streams == -1
    await nc.close()


def test_server_restarts_on_same_port_and_keeps_data(private_server: EmbeddedServer) -> None:
    import asyncio

    async def put() -> None:
        nc = await nats.connect(private_server.url)
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        await js.publish("keep.a", b"x")
        await nc.close()

    async def count() -> int:
        nc = await nats.connect(private_server.url)
        info = await nc.jetstream().stream_info("KEEP")
        await nc.close()
        return int(info.state.messages)

    asyncio.run(put())
    port = private_server.port
    private_server.kill()
    assert not private_server.running
    private_server.start()
    assert private_server.port == port
    assert asyncio.run(count()) == 1


def test_busy_port_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        server = EmbeddedServer(store_dir=tmp_path, port=port, start_timeout=5)
        with pytest.raises(ServerError, match="nats-server"):
            server.start()
        server.close()


# ------------------------------------------------------------------ one server per data directory


def _meshforge(home: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "MESHFORGE_HOME": str(home)}
    return subprocess.Popen(
        [sys.executable, "-m", "meshforge", *args], env=env, cwd=home.parent,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _serving(url: str) -> bool:
    async def info() -> bool:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
        await nc.jetstream().account_info()
        await nc.close()
        return True

    return asyncio.run(info())


def test_second_server_on_the_same_directory_stops_and_leaves_the_first_alone(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    marker = home / "server.json"
    first = _meshforge(home, "server")
    try:
        wait_until_sync(marker.exists, 20, "the first server's server.json")
        announced = json.loads(marker.read_text())
        second = _meshforge(home, "server")
        try:
            out, err = second.communicate(timeout=30)
        finally:
            if second.poll() is None:  # it started a second server: stop it gracefully
                second.send_signal(signal.SIGTERM)
                second.communicate(timeout=30)
        assert second.returncode == 1, out + err
        assert err.count("\n") == 1 and err.startswith("error: data directory"), err
        assert announced["url"] in err and f"pid {announced['pid']}" in err
        # the first one's files and server are untouched
        assert json.loads(marker.read_text()) == announced
        assert _serving(announced["url"])
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    assert first.returncode == 0
    assert not marker.exists()  # the first removes its own marker on the way out


def test_an_orphaned_nats_server_keeps_its_directory_locked(tmp_path: Path) -> None:
    store = tmp_path / "nats"
    code = (
        "import sys, time; from meshforge.transport.server import EmbeddedServer; "
        "s = EmbeddedServer(store_dir=sys.argv[1]).start(); print(s.pid, s.url, flush=True); time.sleep(300)"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code, str(store)], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    pid_text, url = owner.stdout.readline().split()
    orphan = int(pid_text)
    try:
        owner.kill()  # the owning process dies; its nats-server goes on with the lock
        owner.wait()
        assert _serving(url)
        with pytest.raises(ServerError, match=f"in use by nats-server pid {orphan} at {url}"):
            EmbeddedServer(store_dir=store).start()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)
    # once the last holder is gone, the directory can be served again, with its data
    wait_until_sync(lambda: not _alive(orphan), 10, "the orphan to exit")
    # A killed Go program's leader thread is a zombie before its other threads let go of the file.
    wait_until_sync(
        lambda: _lock_free(store / "server.lock"), 10, "the orphan's lock to be released"
    )
    with EmbeddedServer(store_dir=store) as again:
        assert _serving(again.url)


def _lock_free(path: Path) -> bool:
    with path.open("a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(held, fcntl.LOCK_UN)
        return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # not our child: nothing to reap
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


def test_the_same_object_restarts_and_a_stopped_directory_is_free(tmp_path: Path) -> None:
    server = EmbeddedServer(store_dir=tmp_path)
    server.start()
    with pytest.raises(ServerError, match="already in use"):
        EmbeddedServer(store_dir=tmp_path).start()
    server.kill()
    server.start()  # a crash of our own child: restarting it is allowed
    server.close()
    with EmbeddedServer(store_dir=tmp_path) as other:
        assert _serving(other.url)
