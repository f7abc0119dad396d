"""One auth and TLS settings type: the runtime's Settings and the Spark options check alike."""

from __future__ import annotations

import dataclasses
import pickle

import nkeys
import pytest

from meshforge.config import AuthSettings, Settings, load_settings
from meshforge.errors import ConfigError
from meshforge.spark.nats_sync import ConnOptions

AUTH = [f.name for f in dataclasses.fields(AuthSettings)]


def test_settings_and_the_spark_options_take_their_auth_fields_from_one_type() -> None:
    assert issubclass(Settings, AuthSettings) and issubclass(ConnOptions, AuthSettings)
    for cls in (Settings, ConnOptions):
        own = {f.name: f for f in dataclasses.fields(cls)}
        assert [own[name] for name in AUTH] == list(dataclasses.fields(AuthSettings))
    assert "inbox_prefix" in AUTH and len(AUTH) == 10  # nine auth/TLS fields and the inbox


def test_the_spark_options_pickle_and_keep_their_secrets_out_of_repr() -> None:
    seed = nkeys.encode_seed(bytes(32), nkeys.PREFIX_BYTE_USER).decode()
    conn = ConnOptions.from_options(
        {"servers": "nats://bob:pw-9@h:1", "User": "bob", "password": "pw-9", "nkey_seed": seed,
         "connect_attempts": "2"}
    )  # fmt: skip
    back = pickle.loads(pickle.dumps(conn))
    assert back == conn and (back.user, back.nkey_seed, back.connect_attempts) == ("bob", seed, 2)
    for secret in ("pw-9", seed):
        assert secret not in repr(back)


# (setting, Spark option, value): refused by both, each error naming what was written
BAD = [
    ("inbox_prefix", "inbox_prefix", "_INBOX.>"),
    ("inbox_prefix", "inbox_prefix", "a" * 256),
    ("nkey_seed", "nkey_seed", "SUAAAA"),
    ("connect_timeout", "connect_timeout", "-1"),
    ("connect_attempts", "connect_attempts", "zero"),
]


@pytest.mark.parametrize(("setting", "option", "value"), BAD)
def test_a_bad_value_is_refused_by_the_settings_and_the_spark_options_alike(
    setting: str, option: str, value: str
) -> None:
    with pytest.raises(ConfigError) as by_settings:
        load_settings({setting: value}, env={})
    with pytest.raises(ConfigError) as by_spark:
        ConnOptions.from_options({"servers": "nats://h:1", option: value})
    assert str(by_settings.value).startswith(f"{setting}: expected ")
    assert str(by_spark.value).startswith(f"jetstream: {option}: expected ")
    # the same rule, said the same way after the name
    assert (
        str(by_spark.value).partition(": expected ")[2]
        == str(by_settings.value).partition(": expected ")[2]
    )


# (settings, Spark options, the name the error starts with): settings that go together
TOGETHER = [
    ({"tls_cert": "c.pem"}, {"tls_cert": "c.pem"}, "tls_key"),
    ({"password": "pw"}, {"password": "pw"}, "user"),
    ({"creds_file": "u.creds", "nkey_seed_file": "s.nk"}, {"creds": "u.creds", "nkey_seed_file": "s.nk"},
     "nkey_seed_file"),
]  # fmt: skip


@pytest.mark.parametrize(("settings", "options", "name"), TOGETHER)
def test_settings_that_go_together_are_checked_alike(
    settings: dict[str, str], options: dict[str, str], name: str
) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}: expected "):
        load_settings(settings, env={})
    with pytest.raises(ConfigError, match=rf"^jetstream: {name}: expected "):
        ConnOptions.from_options({"servers": "nats://h:1", **options})


def test_the_spark_option_creds_is_named_as_spark_users_write_it() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^jetstream: nkey_seed_file: expected only one of creds, nkey_seed, nkey_seed_file, got creds ",
    ):
        ConnOptions.from_options(
            {"servers": "nats://h:1", "creds": "u.creds", "nkey_seed_file": "s"}
        )
    assert (
        ConnOptions.from_options({"servers": "nats://h:1", "user": " "}).user is None
    )  # blank: unset
