from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from meshforge.config import Settings, load_settings
from meshforge.errors import ConfigError, ConnectionFailed
from meshforge.transport.connection import Connection, connect, redact_url
from meshforge.transport.server import EmbeddedServer
from polling import wait_until


def settings(**values: object) -> Settings:
    return load_settings(values, env={})


async def wait_for_state(conn: Connection, state: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while conn.current_state() != state:
        assert time.monotonic() < deadline, (
            f"state stayed {conn.current_state()!r}, wanted {state!r}"
        )
        await asyncio.sleep(0.05)  # polling the client state with a deadline


async def test_connect_and_health(nats_url: str) -> None:
    async with await connect(settings(), url=nats_url, name="t-health") as conn:
        assert conn.nc.is_connected
        health = await conn.health()
        assert health["state"] == "connected"
        assert health["server"] == nats_url
        assert health["name"] == "t-health"
        usage = health["jetstream"]
        assert set(usage) == {"streams", "consumers", "memory", "storage"}
        assert all(isinstance(v, int) for v in usage.values())
    assert conn.current_state() == "closed"
    assert (await conn.health())["jetstream"] == {"error": "not connected (closed)"}


async def test_url_from_settings(nats_url: str) -> None:
    conn = await connect(settings(nats_url=nats_url))
    try:
        await conn.js.account_info()
    finally:
        await conn.close()


async def test_health_counts_a_new_stream(nats_url: str) -> None:
    async with await connect(url=nats_url) as conn:
        before = (await conn.health())["jetstream"]["streams"]
        await conn.js.add_stream(name="HEALTH_T", subjects=["health-t.>"])
        try:
            assert (await conn.health())["jetstream"]["streams"] == before + 1
        finally:
            await conn.js.delete_stream("HEALTH_T")


async def test_reconnects_after_server_restart(private_server: EmbeddedServer) -> None:
    conn = await connect(settings(), url=private_server.url)
    try:
        await conn.js.add_stream(name="RECON", subjects=["recon.>"])
        await asyncio.to_thread(private_server.kill)
        await wait_for_state(conn, "reconnecting")
        health = await conn.health()
        assert health["state"] == "reconnecting"
        assert "error" in health["jetstream"]
        await asyncio.to_thread(private_server.start)
        await wait_for_state(conn, "connected")
        # nats-py reports connected before its reconnected callback (which counts) has run:
        # a PING round trip apart, seen on a loaded machine.
        await wait_until(lambda: conn.reconnects >= 1, timeout=10, what="the reconnect counted")
        assert conn.reconnects == 1
        ack = await conn.js.publish("recon.a", b"after restart")
        assert ack.stream == "RECON"
        assert (await conn.health())["jetstream"]["streams"] == 1
    finally:
        await conn.close()
    assert conn.state == "closed"


async def test_bad_url_fails_quickly_naming_url_and_error() -> None:
    started = time.monotonic()
    with pytest.raises(ConnectionFailed) as info:
        await connect(settings(connect_attempts=3, connect_timeout=1), url="nats://127.0.0.1:1")
    message = str(info.value)
    assert "nats://127.0.0.1:1" in message
    assert "after 3 attempt(s)" in message
    assert "refused" in message.lower()
    assert "\n" not in message
    # Quickly is the feature: refused at once, two backoffs of at most 0.2 and 0.4 s
    # (0.6 s), over 5x that here.
    assert time.monotonic() - started < 10


async def test_token_auth(tmp_path: Path) -> None:
    async with EmbeddedServer(store_dir=tmp_path, extra_args=["--auth", "s3cret-token"]) as server:
        with pytest.raises(ConnectionFailed, match="Authorization Violation") as info:
            await connect(settings(connect_attempts=5), url=server.url)
        assert "after 1 attempt(s)" in str(info.value)  # a refused login is not retried
        async with await connect(settings(token="s3cret-token"), url=server.url) as conn:
            assert (await conn.health())["state"] == "connected"


async def test_user_password_auth(tmp_path: Path) -> None:
    args = ["--user", "alice", "--pass", "wonderland"]
    async with EmbeddedServer(store_dir=tmp_path, extra_args=args) as server:
        with pytest.raises(ConnectionFailed, match="Authorization Violation"):
            await connect(
                settings(user="alice", password="wrong", connect_attempts=2), url=server.url
            )
        async with await connect(
            settings(user="alice", password="wonderland"), url=server.url
        ) as conn:
            info = await conn.js.account_info()
            assert info.streams == 0
        # credentials in the URL work too, and never show in errors or health
        url = server.url.replace("nats://", "nats://alice:wonderland@")
        async with await connect(settings(), url=url) as conn:
            assert "wonderland" not in str(await conn.health())


def test_redact_url() -> None:
    assert redact_url("nats://a:b@h:1,nats://h2:2") == "nats://***@h:1,nats://h2:2"
    assert redact_url("nats://tok@h:4222") == "nats://***@h:4222"
    assert redact_url("nats://h:4222") == "nats://h:4222"


async def test_missing_creds_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^creds_file: expected a readable file"):
        await connect(settings(creds_file=str(tmp_path / "none.creds")), url="nats://127.0.0.1:1")


async def test_unreadable_tls_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^tls_ca: expected a readable file"):
        await connect(settings(tls_ca=str(tmp_path / "nope.pem")), url="tls://127.0.0.1:1")
