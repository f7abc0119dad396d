from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshforge.config import Settings, load_settings, parse_backoff, parse_duration
from meshforge.errors import ConfigError

NO_ENV: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _no_default_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs where no ./meshforge.toml exists unless it writes one."""
    monkeypatch.chdir(tmp_path)


def test_defaults_match_the_contract() -> None:
    s = load_settings(env=NO_ENV)
    assert s == Settings()
    assert s.max_deliver == 5
    assert s.backoff == (1.0, 5.0, 10.0, 30.0)
    assert s.duplicate_window == 120.0
    assert s.storage == "file"
    assert s.store_url == "sqlite:///.meshforge/store.db"
    assert s.nats_url is None


def test_settings_are_frozen() -> None:
    s = load_settings(env=NO_ENV)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_deliver = 7  # type: ignore[misc]


def test_secrets_are_not_in_repr() -> None:
    s = load_settings({"user": "u", "password": "hunter2", "token": "t0ken"}, env=NO_ENV)
    assert "hunter2" not in repr(s)
    assert "t0ken" not in repr(s)


# ------------------------------------------------------------------ each source


def test_environment_values_are_parsed() -> None:
    env = {
        "MESHFORGE_NATS_URL": "nats://10.0.0.1:4222",
        "MESHFORGE_MAX_DELIVER": "7",
        "MESHFORGE_ACK_WAIT": "2m",
        "MESHFORGE_BACKOFF": "500ms, 2s,1m",
        "MESHFORGE_LOG_JSON": "yes",
        "MESHFORGE_PROVISION": "0",
        "MESHFORGE_STORAGE": "MEMORY",
        "MESHFORGE_METRICS_PORT": "9100",
        "MESHFORGE_LOG_LEVEL": "debug",
        "MESHFORGE_TENANT": "acme",
    }
    s = load_settings(env=env)
    assert s.nats_url == "nats://10.0.0.1:4222"
    assert s.max_deliver == 7
    assert s.ack_wait == 120.0
    assert s.backoff == (0.5, 2.0, 60.0)
    assert s.log_json is True
    assert s.provision is False
    assert s.storage == "memory"
    assert s.metrics_port == 9100
    assert s.log_level == "DEBUG"
    assert s.tenant == "acme"


def test_empty_environment_values_count_as_unset() -> None:
    assert load_settings(env={"MESHFORGE_MAX_DELIVER": "", "MESHFORGE_TOKEN": "  "}) == Settings()


def test_unrelated_meshforge_variables_are_ignored() -> None:
    assert (
        load_settings(env={"MESHFORGE_CRASH_AT": "after_ack", "MESHFORGE_HOME": "/x"}) == Settings()
    )


def test_toml_file_values_are_parsed(tmp_path: Path) -> None:
    path = tmp_path / "custom.toml"
    path.write_text(
        'nats_url = "nats://a:4222,nats://b:4222"\nmax_deliver = 3\nack_wait = "45s"\n'
        'backoff = ["1s", 2, 0.5]\nmax_age = "1d"\nlog_json = true\nmax_bytes = 1048576\n'
    )
    s = load_settings(env=NO_ENV, config_file=str(path))
    assert s.nats_url == "nats://a:4222,nats://b:4222"
    assert s.max_deliver == 3
    assert s.ack_wait == 45.0
    assert s.backoff == (1.0, 2.0, 0.5)
    assert s.max_age == 86400.0
    assert s.log_json is True
    assert s.max_bytes == 1048576


def test_meshforge_config_variable_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "elsewhere.toml"
    path.write_text("batch_size = 9\n")
    assert load_settings(env={"MESHFORGE_CONFIG": str(path)}).batch_size == 9


def test_meshforge_toml_in_the_working_directory_is_read(tmp_path: Path) -> None:
    (tmp_path / "meshforge.toml").write_text("concurrency = 3\n")
    assert load_settings(env=NO_ENV).concurrency == 3


def test_overrides_ignore_none() -> None:
    s = load_settings(
        {"max_deliver": None, "nats_url": None, "batch_size": 2}, env={"MESHFORGE_MAX_DELIVER": "4"}
    )
    assert s.max_deliver == 4
    assert s.batch_size == 2


# ------------------------------------------------------------------ precedence


def test_precedence_override_env_file_default(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("max_deliver = 2\nbatch_size = 2\nconcurrency = 2\n")
    env = {"MESHFORGE_MAX_DELIVER": "3", "MESHFORGE_BATCH_SIZE": "3"}
    s = load_settings({"max_deliver": 4}, env=env, config_file=path)
    assert s.max_deliver == 4  # override beats env and file
    assert s.batch_size == 3  # env beats file
    assert s.concurrency == 2  # file beats default
    assert s.publish_attempts == 5  # default


@given(
    in_file=st.none() | st.integers(1, 1000),
    in_env=st.none() | st.integers(1, 1000),
    in_override=st.none() | st.integers(1, 1000),
)
def test_precedence_property(
    tmp_path_factory: pytest.TempPathFactory,
    in_file: int | None,
    in_env: int | None,
    in_override: int | None,
) -> None:
    path = tmp_path_factory.mktemp("prec") / "m.toml"
    path.write_text(f"connect_attempts = {in_file}\n" if in_file is not None else "")
    env = {"MESHFORGE_CONNECT_ATTEMPTS": str(in_env)} if in_env is not None else {}
    s = load_settings({"connect_attempts": in_override}, env=env, config_file=path)
    expected = next(v for v in (in_override, in_env, in_file, 10) if v is not None)
    assert s.connect_attempts == expected


# ------------------------------------------------------------------ parsing


@given(n=st.integers(0, 10**6), unit=st.sampled_from(["ms", "s", "m", "h", "d", ""]))
def test_duration_strings(n: int, unit: str) -> None:
    factor = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "": 1}[unit]
    assert parse_duration(f"{n}{unit}") == pytest.approx(n * factor)


@given(st.floats(min_value=0, max_value=1e9, allow_nan=False))
def test_duration_numbers_are_seconds(x: float) -> None:
    assert parse_duration(x) == x


@given(st.lists(st.integers(1, 10**5), min_size=1, max_size=8))
def test_backoff_string_and_list_agree(ms: list[int]) -> None:
    text = ",".join(f"{v}ms" for v in ms)
    assert parse_backoff(text) == parse_backoff([f"{v}ms" for v in ms])
    assert parse_backoff(text) == pytest.approx(tuple(v / 1000 for v in ms))


@pytest.mark.parametrize(
    "word,value",
    [
        ("true", True),
        ("Yes", True),
        ("1", True),
        ("on", True),
        ("false", False),
        ("NO", False),
        ("0", False),
        ("off", False),
    ],
)
def test_booleans(word: str, value: bool) -> None:
    assert load_settings(env={"MESHFORGE_LOG_JSON": word}).log_json is value


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "env,message",
    [
        (
            {"MESHFORGE_MAX_DELIVER": "abc"},
            "MESHFORGE_MAX_DELIVER: expected an integer >= 1, got 'abc'",
        ),
        (
            {"MESHFORGE_MAX_DELIVER": "0"},
            "MESHFORGE_MAX_DELIVER: expected an integer >= 1, got '0'",
        ),
        ({"MESHFORGE_ACK_WAIT": "soon"}, "MESHFORGE_ACK_WAIT: expected a duration"),
        ({"MESHFORGE_ACK_WAIT": "0s"}, "MESHFORGE_ACK_WAIT: expected a duration > 0"),
        ({"MESHFORGE_BACKOFF": "1s,x"}, "MESHFORGE_BACKOFF: expected a list of durations"),
        ({"MESHFORGE_BACKOFF": "1s,0s"}, "MESHFORGE_BACKOFF: expected a list of durations > 0"),
        ({"MESHFORGE_LOG_JSON": "maybe"}, "MESHFORGE_LOG_JSON: expected true or false"),
        (
            {"MESHFORGE_STORAGE": "disk"},
            "MESHFORGE_STORAGE: expected one of file, memory, got 'disk'",
        ),
        ({"MESHFORGE_NATS_URL": "http://x"}, "MESHFORGE_NATS_URL: expected a URL"),
        ({"MESHFORGE_STORE_URL": "mysql://x"}, "MESHFORGE_STORE_URL: expected sqlite:///path"),
        (
            {"MESHFORGE_METRICS_PORT": "70000"},
            "MESHFORGE_METRICS_PORT: expected an integer from 0 to 65535",
        ),
        ({"MESHFORGE_MAX_BYTES": "-2"}, "MESHFORGE_MAX_BYTES: expected an integer >= 1 or -1"),
        ({"MESHFORGE_TENANT": "a.b"}, "MESHFORGE_TENANT: expected 1 to 64 characters"),
        ({"MESHFORGE_LOG_LEVEL": "loud"}, "MESHFORGE_LOG_LEVEL: expected one of DEBUG"),
    ],
)
def test_bad_environment_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env=env)
    text = str(info.value)
    assert text.startswith(message)
    assert "\n" not in text


def test_bad_file_value_names_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("max_deliver = true\n")
    with pytest.raises(
        ConfigError, match=r"^max_deliver in .*bad\.toml: expected an integer >= 1, got True$"
    ):
        load_settings(env=NO_ENV, config_file=path)


def test_bad_override_names_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"^batch_size: expected an integer >= 1, got 1\.5$"):
        load_settings({"batch_size": 1.5}, env=NO_ENV)


def test_unknown_key_in_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text("max_delivers = 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'max_delivers'"):
        load_settings(env=NO_ENV, config_file=path)


def test_unknown_override_is_an_error() -> None:
    with pytest.raises(ConfigError, match="unknown setting 'speed'"):
        load_settings({"speed": 3}, env=NO_ENV)


def test_invalid_toml_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("max_deliver = = 3\n")
    with pytest.raises(ConfigError, match="invalid TOML") as info:
        load_settings(env=NO_ENV, config_file=path)
    assert "\n" not in str(info.value)


def test_missing_named_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="MESHFORGE_CONFIG: file not found"):
        load_settings(env={"MESHFORGE_CONFIG": str(tmp_path / "nope.toml")})


def test_environment_error_beats_a_good_override() -> None:
    # validated once, whole: a bad value anywhere is reported even if overridden
    with pytest.raises(ConfigError, match="MESHFORGE_BATCH_SIZE"):
        load_settings({"batch_size": 3}, env={"MESHFORGE_BATCH_SIZE": "many"})


def test_duplicate_window_cannot_exceed_max_age() -> None:
    with pytest.raises(
        ConfigError, match=r"^duplicate_window: expected at most max_age \(60s\), got 120s$"
    ):
        load_settings({"max_age": "1m"}, env=NO_ENV)
    assert load_settings({"max_age": "1m", "duplicate_window": "30s"}, env=NO_ENV).max_age == 60.0


def test_tls_cert_needs_key() -> None:
    with pytest.raises(ConfigError, match=r"^tls_key:"):
        load_settings({"tls_cert": "/c.pem"}, env=NO_ENV)


def test_password_needs_user() -> None:
    with pytest.raises(ConfigError, match=r"^user:"):
        load_settings({"password": "p"}, env=NO_ENV)


def test_public_parsers_raise_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^delay: expected a duration"):
        parse_duration("later", "delay")
    with pytest.raises(ConfigError, match=r"^backoff: expected"):
        parse_backoff(5)
