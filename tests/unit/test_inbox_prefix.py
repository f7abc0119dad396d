"""Each client's reply inbox: from the user, the URL's user, or MESHFORGE_INBOX_PREFIX."""

from __future__ import annotations

import pytest

from meshforge.config import AuthSettings, load_settings
from meshforge.errors import ConfigError
from meshforge.spark.nats_sync import ConnOptions
from meshforge.transport.credentials import nats_auth_options, url_user, user_inbox_prefix


def test_the_prefix_comes_from_the_user_or_the_setting() -> None:
    assert (
        nats_auth_options(AuthSettings(user="acme-pub", password="x"))["inbox_prefix"]
        == "_INBOX_acme-pub"
    )
    assert (
        nats_auth_options(AuthSettings(user="a.b c*", password="x"))["inbox_prefix"]
        == "_INBOX_a_b_c_"
    )
    explicit = load_settings({"user": "u", "password": "p", "inbox_prefix": "_INBOX_team"}, env={})
    assert nats_auth_options(explicit)["inbox_prefix"] == "_INBOX_team"
    env = load_settings(env={"MESHFORGE_INBOX_PREFIX": "replies.acme"})
    assert nats_auth_options(env)["inbox_prefix"] == "replies.acme"
    assert "inbox_prefix" not in nats_auth_options(
        AuthSettings(token="t")
    )  # the URL's user, else _INBOX
    assert user_inbox_prefix(None) == "_INBOX"


def test_a_urls_user_names_the_prefix_but_a_token_never_does() -> None:
    assert url_user(["nats://bob:pw@h:4222"]) == "bob"
    assert url_user(["nats://h1:1", "tls://eve:x@h2:2"]) == "eve"
    assert url_user(["nats://s3cret-token@h:4222"]) is None  # a lone user@ is a token
    assert url_user(["nats://h:4222"]) is None


@pytest.mark.parametrize("bad", ["_INBOX.>", "_INBOX.*", "a..b", "has space"])
def test_a_prefix_with_a_wildcard_or_a_bad_token_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="inbox_prefix"):
        load_settings({"inbox_prefix": bad}, env={})
    with pytest.raises(ConfigError, match="inbox_prefix"):
        ConnOptions.from_options({"servers": "nats://h:1", "inbox_prefix": bad})


def test_the_spark_client_takes_the_prefix_from_its_options_or_the_user() -> None:
    conn = ConnOptions.from_options({"servers": "nats://h:1", "user": "spark-1", "password": "p"})
    assert conn.auth_kwargs()["inbox_prefix"] == "_INBOX_spark-1"
    own = ConnOptions.from_options({"servers": "nats://h:1", "Inbox_Prefix": "_INBOX_lake"})
    assert own.auth_kwargs()["inbox_prefix"] == "_INBOX_lake"
