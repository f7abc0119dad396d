"""Every auth method against a real nats-server configured for it: the right credentials
connect and use JetStream; wrong ones end in one line within connect_timeout x attempts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nkeys
import pytest
from auth_support import configured_server, make_certs, make_operator, new_key, tls_block

from meshforge.config import Settings, load_settings
from meshforge.errors import ConfigError, ConnectionFailed
from meshforge.transport.connection import connect

TIMEOUT, ATTEMPTS = 1.0, 2
# every attempt may take connect_timeout; a failed one adds a bounded close and backoff
# (and slack for a loaded machine)
BOUND = TIMEOUT * ATTEMPTS + 3.0


def settings(**values: object) -> Settings:
    return load_settings(
        {"connect_timeout": TIMEOUT, "connect_attempts": ATTEMPTS, **values}, env={}
    )


async def works(url: str, s: Settings) -> None:
    """Connects, creates a stream, publishes and reads account usage."""
    async with await connect(s, url=url) as conn:
        name = f"AUTH_{int(time.monotonic_ns() % 10**9)}"
        await conn.js.add_stream(name=name, subjects=[f"{name.lower()}.>"])
        ack = await conn.js.publish(f"{name.lower()}.a", b"{}")
        assert ack.stream == name
        health = await conn.health()
        assert health["state"] == "connected"
        assert health["jetstream"]["streams"] >= 1


async def refused(url: str, s: Settings, *expected: str) -> str:
    """Fails with one ConnectionFailed line naming the URL, within the bound."""
    started = time.monotonic()
    with pytest.raises(ConnectionFailed) as info:
        await asyncio.wait_for(connect(s, url=url), 30)  # a hang fails the test, not the run
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert elapsed < BOUND, f"took {elapsed:.1f}s: {message}"
    assert "\n" not in message
    assert message.startswith(f"cannot connect to NATS at {url} ")
    for text in expected:
        assert text.lower() in message.lower(), message
    return message


async def test_user_password(tmp_path: Path) -> None:
    config = "authorization { user: alice, password: wonderland }\n"
    with configured_server(tmp_path, config) as server:
        await works(server.url, settings(user="alice", password="wonderland"))
        message = await refused(
            server.url, settings(user="alice", password="wrong"), "Authorization Violation",
            "after 1 attempt(s)", "hint: check the user/password",
        )  # fmt: skip
        assert "wrong" not in message
        await refused(server.url, settings(), "Authorization Violation")


async def test_token(tmp_path: Path) -> None:
    with configured_server(tmp_path, "authorization { token: s3cret-token }\n") as server:
        await works(server.url, settings(token="s3cret-token"))
        message = await refused(server.url, settings(token="not-it"), "Authorization Violation")
        assert "not-it" not in message


async def test_nkey_seed_as_setting_and_as_file(tmp_path: Path) -> None:
    user = new_key(nkeys.PREFIX_BYTE_USER)
    seed_file = tmp_path / "user.nk"
    seed_file.write_text(user.seed + "\n")
    config = f"authorization {{ users = [ {{ nkey: {user.public} }} ] }}\n"
    with configured_server(tmp_path, config) as server:
        await works(server.url, settings(nkey_seed=user.seed))
        await works(server.url, settings(nkey_seed_file=str(seed_file)))
        stranger = new_key(nkeys.PREFIX_BYTE_USER).seed
        message = await refused(server.url, settings(nkey_seed=stranger), "Authorization Violation")
        assert stranger not in message
        await refused(server.url, settings(), "Authorization Violation")


async def test_a_malformed_seed_is_a_config_error_that_hides_it(tmp_path: Path) -> None:
    account_seed = new_key(nkeys.PREFIX_BYTE_ACCOUNT).seed  # a seed, but not a user's
    for bad in ("SUNOTASEED", account_seed, mistyped(new_key(nkeys.PREFIX_BYTE_USER).seed)):
        with pytest.raises(
            ConfigError, match=r"^MESHFORGE_NKEY_SEED: expected an NKey user seed"
        ) as info:
            load_settings(env={"MESHFORGE_NKEY_SEED": bad})
        assert bad not in str(info.value)
    seed_file = tmp_path / "bad.nk"
    seed_file.write_text(account_seed)
    with pytest.raises(
        ConfigError, match=r"^nkey_seed_file .*: expected an NKey user seed"
    ) as info:
        await connect(settings(nkey_seed_file=str(seed_file)), url="nats://127.0.0.1:1")
    assert account_seed not in str(info.value)


async def test_credentials_file_with_own_operator(tmp_path: Path) -> None:
    op = make_operator()
    with configured_server(tmp_path, op.config()) as server:
        creds = op.creds(tmp_path / "user.creds")
        await works(server.url, settings(creds_file=str(creds)))
        # a user of another operator, and the right JWT with a seed that is not its own
        other = make_operator().creds(tmp_path / "other.creds")
        await refused(server.url, settings(creds_file=str(other)), "Authorization Violation")
        stolen_jwt = op.creds(tmp_path / "mixed.creds", seed=new_key(nkeys.PREFIX_BYTE_USER).seed)
        await refused(server.url, settings(creds_file=str(stolen_jwt)), "Authorization Violation")
        await refused(server.url, settings(), "Authorization Violation")


async def test_a_broken_credentials_file_is_a_config_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.creds"
    broken.write_text("not a credentials file\n")  # nats-py would loop for ever reading it
    with pytest.raises(ConfigError, match=r"^creds_file: expected a credentials file"):
        await asyncio.wait_for(
            connect(settings(creds_file=str(broken)), url="nats://127.0.0.1:1"), 10
        )


def test_only_one_key_based_method() -> None:
    seed = new_key(nkeys.PREFIX_BYTE_USER).seed
    with pytest.raises(ConfigError, match=r"^nkey_seed: expected only one of creds_file"):
        settings(creds_file="/x.creds", nkey_seed=seed)


async def test_tls_with_ca(tmp_path: Path) -> None:
    certs = await asyncio.to_thread(make_certs, tmp_path / "certs")
    with configured_server(tmp_path, tls_block(certs)) as server:
        url = server.url.replace("nats://", "tls://")
        await works(url, settings(tls_ca=str(certs["ca"])))
        # without a CA (system trust) and with another CA: refused at once, no hang
        for s in (settings(), settings(tls_ca=str(certs["other-ca"]))):
            await refused(
                url, s, "CERTIFICATE_VERIFY_FAILED", "after 1 attempt(s)", "hint: set tls_ca"
            )


async def test_mutual_tls(tmp_path: Path) -> None:
    certs = await asyncio.to_thread(make_certs, tmp_path / "certs")
    with configured_server(tmp_path, tls_block(certs, verify=True)) as server:
        url = server.url.replace("nats://", "tls://")
        client = {"tls_cert": str(certs["cli"]), "tls_key": str(certs["cli-key"])}
        await works(url, settings(tls_ca=str(certs["ca"]), **client))
        await refused(url, settings(tls_ca=str(certs["ca"])), "hint:", "client certificate")
        await refused(url, settings(**client), "CERTIFICATE_VERIFY_FAILED")  # no CA


async def test_tls_and_password(tmp_path: Path) -> None:
    certs = await asyncio.to_thread(make_certs, tmp_path / "certs")
    config = tls_block(certs) + "authorization { user: alice, password: wonderland }\n"
    with configured_server(tmp_path, config) as server:
        url = server.url.replace("nats://", "tls://")
        ca = str(certs["ca"])
        await works(url, settings(tls_ca=ca, user="alice", password="wonderland"))
        await refused(
            url, settings(tls_ca=ca, user="alice", password="wrong"), "Authorization Violation"
        )
        await refused(
            url, settings(user="alice", password="wonderland"), "CERTIFICATE_VERIFY_FAILED"
        )


async def test_refused_port_retries_with_a_progress_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="meshforge.connection")
    url = "nats://127.0.0.1:1"
    await refused(url, settings(connect_attempts=3), "after 3 attempt(s)", "refused")
    lines = [r.getMessage() for r in caplog.records if r.name == "meshforge.connection"]
    assert len(lines) == 2, lines  # one per retry, none after the last attempt
    assert lines[0].startswith(f"NATS at {url} not reachable (")
    assert "retrying in" in lines[0] and "(attempt 1 of 3)" in lines[0]
    assert "(attempt 2 of 3)" in lines[1]


async def test_secrets_stay_out_of_logs_health_and_repr(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")  # every logger, the client library's too
    secret = "Pw-in-url-9931"
    config = f"authorization {{ user: alice, password: {secret} }}\n"
    with configured_server(tmp_path, config) as server:
        url = server.url.replace("nats://", f"nats://alice:{secret}@")
        s = settings(nats_url=url, user="alice", password=secret)
        async with await connect(s, url=url) as conn:
            shown = [repr(s), str(await conn.health())]
        server.stop()  # reconnect warnings name the server as well
        with pytest.raises(ConnectionFailed) as info:
            await connect(s, url=url)
        shown.append(str(info.value))
    shown += [record.getMessage() for record in caplog.records]
    assert any("not reachable" in text for text in shown)
    for text in shown:
        assert secret not in text, text


def test_spark_connection_options_hide_secrets() -> None:
    from meshforge.spark.nats_sync import ConnOptions

    seed = new_key(nkeys.PREFIX_BYTE_USER).seed
    options = {"servers": "nats://alice:pw-1@h:1", "user": "alice", "password": "pw-1",
               "token": "tok-1", "nkey_seed": seed, "connect_timeout": "2s"}  # fmt: skip
    conn = ConnOptions.from_options(options)
    assert (conn.connect_timeout, conn.connect_attempts) == (2.0, 3)
    for secret in ("pw-1", "tok-1", seed):
        assert secret not in repr(conn)
    assert conn.url == "nats://***@h:1"
    with pytest.raises(
        ConfigError, match=r"^jetstream: nkey_seed: expected an NKey user seed"
    ) as info:
        ConnOptions.from_options({**options, "nkey_seed": mistyped(seed)})
    assert seed[:10] not in str(info.value)


def mistyped(seed: str) -> str:
    """The seed with one character changed: its CRC no longer matches."""
    return seed[:10] + ("A" if seed[10] != "A" else "B") + seed[11:]
