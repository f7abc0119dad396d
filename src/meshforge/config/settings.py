"""Settings: from arguments, the environment, a TOML file or defaults, validated once.

Precedence, highest first: ``overrides`` (``None`` values ignored) > environment
``MESHFORGE_<FIELD>`` > the TOML file (``config_file``, else ``$MESHFORGE_CONFIG``, else
``./meshforge.toml`` when it exists) > defaults. A bad value raises ``ConfigError`` with one
line naming the setting as it was written, the value and what was expected::

    MESHFORGE_MAX_DELIVER: expected an integer >= 1, got 'abc'

Durations take seconds (``30``, ``0.5``) or strings such as ``"500ms"``, ``"30s"``,
``"2m"``, ``"1h"``; ``backoff`` takes ``"1s,5s,10s,30s"`` or a list; booleans take
``true/false/1/0/yes/no/on/off``.

Example::

    >>> s = load_settings({"max_deliver": 3}, env={"MESHFORGE_ACK_WAIT": "1m"})
    >>> (s.max_deliver, s.ack_wait)
    (3, 60.0)
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from meshforge.config.auth import AUTH_FIELDS, AuthSettings, check_nkey_seed, redact_url
from meshforge.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "SECRET_SETTINGS",
    "Settings",
    "load_auth",
    "load_settings",
    "parse_backoff",
    "parse_duration",
    "parse_setting",
    "redelivery_span",
]

ENV_PREFIX = "MESHFORGE_"
DEFAULT_FILE = "meshforge.toml"
# Never shown: not in errors, not in repr
SECRET_SETTINGS = frozenset(
    {"password", "token", "nkey_seed", "console_viewer_token", "console_operator_token"}
)
# Shown without their user info (a password may sit in the URL)
_URL_SETTINGS = frozenset({"nats_url", "store_url"})


@dataclass(frozen=True, slots=True)
class Settings(AuthSettings):
    """Every knob of MeshForge; build it with ``load_settings`` so values are validated.

    The auth and TLS settings (``user`` ... ``tls_key``, ``inbox_prefix``) are
    ``AuthSettings``' own, declared there once."""

    nats_url: str | None = None
    store_url: str = "sqlite:///.meshforge/store.db"
    # What a store commit survives before its commands are acknowledged: "sync" (a power
    # cut: every commit synced) or "os" (a killed process, not a power cut). STORE.md.
    durability: Literal["sync", "os"] = "sync"
    connect_timeout: float = 5.0
    connect_attempts: int = 10
    max_deliver: int = 5
    ack_wait: float = 30.0
    backoff: tuple[float, ...] = (1.0, 5.0, 10.0, 30.0)
    duplicate_window: float = 120.0
    replicas: int = 1
    consumer_replicas: int | None = (
        None  # None: as many as the streams; 0: inherit (nats' own rule)
    )
    storage: Literal["file", "memory"] = "file"
    max_age: float = 0.0
    max_bytes: int = -1
    # Consumers MESHFORGE_CONTROL takes: one per node (its mailbox); -1, unlimited.
    control_max_consumers: int = -1
    # How often a node's waiting pull request hears from the server (it waits 5 times as
    # long for a command): the idle traffic of each node. CONTROL_PLANE.md "Limits".
    node_pull_heartbeat: float = 5.0
    batch_size: int = 64
    concurrency: int = 8
    partitions: int = 0
    partition_lease: float = 6.0
    publish_timeout: float = 5.0
    publish_attempts: int = 5
    publish_backoff_base: float = 0.1
    publish_backoff_cap: float = 5.0
    provision: bool = True
    tenant: str | None = None
    namespace: str | None = None
    shutdown_timeout: float = 30.0
    # An async handler's time limit (a plain def cannot be interrupted): kept alive with
    # in_progress meanwhile; an agent's ``timeout`` and ``@command(timeout=)`` override it.
    handler_timeout: float = 300.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    inbox_retention: float = 7 * 86400.0
    effect_retention: float = 7 * 86400.0
    retention_interval: float = 3600.0
    outbox_retention: float = 86400.0
    reply_retention: float = 30 * 86400.0
    log_level: str = "INFO"
    log_json: bool = False
    console_viewer_token: str | None = field(default=None, repr=False)
    console_viewer_token_file: str | None = None
    console_operator_token: str | None = field(default=None, repr=False)
    console_operator_token_file: str | None = None
    console_session_idle: float = 1800.0

    def __repr__(self) -> str:
        # URLs may carry a password; secrets are left out (see SECRET_SETTINGS)
        shown = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in SECRET_SETTINGS:
                continue
            if f.name in _URL_SETTINGS and isinstance(value, str):
                value = redact_url(value)
            shown.append(f"{f.name}={value!r}")
        return f"Settings({', '.join(shown)})"


# ---------------------------------------------------------------- value parsers
# Each parser returns the clean value or raises _Bad(expected) saying what it wanted.


class _Bad(Exception):
    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*", re.IGNORECASE)


def _seconds(value: object) -> float:
    if isinstance(value, bool):
        raise _Bad("a duration such as 30, '500ms', '30s' or '2m'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.fullmatch(value)):
        seconds = float(m.group(1)) * _UNITS[(m.group(2) or "s").lower()]
    else:
        raise _Bad("a duration such as 30, '500ms', '30s' or '2m'")
    if not math.isfinite(seconds) or seconds < 0:
        raise _Bad("a duration >= 0 such as 30, '500ms', '30s' or '2m'")
    return seconds


def _delays(value: object) -> tuple[float, ...]:
    expected = "a list of durations > 0 such as '1s,5s,10s,30s'"
    if isinstance(value, str):
        items: list[object] = [p for p in (s.strip() for s in value.split(",")) if p]
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise _Bad(expected)
    try:
        delays = tuple(_seconds(item) for item in items)
    except _Bad:
        raise _Bad(expected) from None
    if any(d <= 0 for d in delays):
        raise _Bad(expected)
    return delays


def _integer(value: object, expected: str) -> int:
    if isinstance(value, bool):
        raise _Bad(expected)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d+\s*", value):
        return int(value)
    raise _Bad(expected)


def _int_at_least(low: int, *, minus_one: bool = False) -> Callable[[object], int]:
    expected = f"an integer >= {low}" + (" or -1 (unlimited)" if minus_one else "")

    def parse(value: object) -> int:
        number = _integer(value, expected)
        if number < low and not (minus_one and number == -1):
            raise _Bad(expected)
        return number

    return parse


def _int_between(low: int, high: int) -> Callable[[object], int]:
    expected = f"an integer from {low} to {high}"

    def parse(value: object) -> int:
        number = _integer(value, expected)
        if not low <= number <= high:
            raise _Bad(expected)
        return number

    return parse


def _duration(*, positive: bool) -> Callable[[object], float]:
    def parse(value: object) -> float:
        seconds = _seconds(value)
        if positive and seconds <= 0:
            raise _Bad("a duration > 0 such as 30, '500ms', '30s' or '2m'")
        return seconds

    return parse


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _boolean(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _Bad("true or false (also 1/0, yes/no, on/off)")


def _text(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Bad("a non-empty string")
    return value.strip()


def _choice(*options: str, upper: bool = False) -> Callable[[object], str]:
    def parse(value: object) -> str:
        if isinstance(value, str):
            norm = value.strip().upper() if upper else value.strip().lower()
            if norm in options:
                return norm
        raise _Bad("one of " + ", ".join(options))

    return parse


_NATS_SCHEMES = ("nats://", "tls://", "ws://", "wss://")


def _nats_url(value: object) -> str:
    text = _text(value)
    urls = [u.strip() for u in text.split(",")]
    if not all(u.lower().startswith(_NATS_SCHEMES) and len(u) > 7 for u in urls):
        raise _Bad("a URL such as nats://host:4222 (several separated by commas)")
    return ",".join(urls)


def _store_url(value: object) -> str:
    text = _text(value)
    if not text.startswith(("sqlite:///", "postgresql://", "postgres://")):
        raise _Bad("sqlite:///path or postgresql://user@host/db")
    return text


_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _subject_token(value: object) -> str:
    if isinstance(value, str) and _TOKEN.fullmatch(value.strip()):
        return value.strip()
    raise _Bad("1 to 64 characters of A-Z a-z 0-9 _ -")


_MAX_SUBJECT = 255  # CONTRACT.md: a subject is at most 255 characters of such tokens


def _inbox_prefix(value: object) -> str:
    text = _text(value)
    if len(text) <= _MAX_SUBJECT and all(_TOKEN.fullmatch(t) for t in text.split(".")):
        return text
    raise _Bad("a subject without wildcards, such as _INBOX_acme")


def _nkey_seed(value: object) -> str:
    text = _text(value)
    try:
        return check_nkey_seed(text)
    except ConfigError:
        raise _Bad("an NKey user seed (58 characters starting with SU)") from None


_PARSERS: dict[str, Callable[[object], Any]] = {
    "nats_url": _nats_url,
    "store_url": _store_url,
    "user": _text,
    "password": _text,
    "token": _text,
    "creds_file": _text,
    "nkey_seed": _nkey_seed,
    "nkey_seed_file": _text,
    "tls_ca": _text,
    "tls_cert": _text,
    "tls_key": _text,
    "inbox_prefix": _inbox_prefix,
    "connect_timeout": _duration(positive=True),
    "connect_attempts": _int_at_least(1),
    "max_deliver": _int_at_least(1),
    "ack_wait": _duration(positive=True),
    "backoff": _delays,
    "duplicate_window": _duration(positive=True),
    "replicas": _int_between(1, 5),
    "consumer_replicas": _int_between(0, 5),
    "storage": _choice("file", "memory"),
    "durability": _choice("sync", "os"),
    "max_age": _duration(positive=False),
    "max_bytes": _int_at_least(1, minus_one=True),
    "control_max_consumers": _int_at_least(1, minus_one=True),
    "node_pull_heartbeat": _duration(positive=True),
    "batch_size": _int_at_least(1),
    "concurrency": _int_at_least(1),
    "partitions": _int_between(0, 1024),
    "partition_lease": _duration(positive=True),
    "publish_timeout": _duration(positive=True),
    "publish_attempts": _int_at_least(1),
    "publish_backoff_base": _duration(positive=True),
    "publish_backoff_cap": _duration(positive=True),
    "provision": _boolean,
    "tenant": _subject_token,
    "namespace": _subject_token,
    "shutdown_timeout": _duration(positive=False),
    "handler_timeout": _duration(positive=True),
    "metrics_port": _int_between(0, 65535),
    "metrics_host": _text,
    "inbox_retention": _duration(positive=False),
    "effect_retention": _duration(positive=False),
    "retention_interval": _duration(positive=True),
    "outbox_retention": _duration(positive=False),
    "reply_retention": _duration(positive=False),
    "log_level": _choice("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", upper=True),
    "log_json": _boolean,
    "console_viewer_token": _text,
    "console_viewer_token_file": _text,
    "console_operator_token": _text,
    "console_operator_token_file": _text,
    "console_session_idle": _duration(positive=True),
}
assert set(_PARSERS) == {f.name for f in dataclasses.fields(Settings)}, "a setting lacks a parser"


def parse_duration(value: object, label: str = "duration") -> float:
    """Seconds from ``30``, ``0.5``, ``"500ms"``, ``"30s"``, ``"2m"``, ``"1h"``, ``"1d"``.

    Raises ``ConfigError`` naming ``label``.

    >>> parse_duration("2m")
    120.0
    """
    return float(_parse_with(_seconds, value, label))


def parse_backoff(value: object, label: str = "backoff") -> tuple[float, ...]:
    """Delays from ``"1s,5s,10s,30s"`` or a list of durations; each must be > 0.

    >>> parse_backoff("1s, 500ms")
    (1.0, 0.5)
    """
    return tuple(_parse_with(_delays, value, label))


def _parse_with(parser: Callable[[object], Any], value: object, label: str, key: str = "") -> Any:
    try:
        return parser(value)
    except _Bad as bad:
        raise _fail(label, value, bad.expected, key) from None


def _fail(label: str, value: object, expected: str, key: str = "") -> ConfigError:
    if key in SECRET_SETTINGS:
        size = len(value) if isinstance(value, str) else 0
        return ConfigError(
            f"{label}: expected {expected}, got a value of {size} characters (not shown)"
        )
    if key in _URL_SETTINGS and isinstance(value, str):
        value = redact_url(value)
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ConfigError(f"{label}: expected {expected}, got {shown}")


def _read_file(path: Path, label: str) -> dict[str, object]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{label}: file not found: {str(path)!r}") from None
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read {str(path)!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    unknown = sorted(set(data) - set(_PARSERS))
    if unknown:
        raise ConfigError(
            f"{path}: unknown setting {unknown[0]!r}; known settings: {', '.join(_PARSERS)}"
        )
    return data


def _config_path(
    config_file: str | os.PathLike[str] | None, env: Mapping[str, str]
) -> tuple[Path, str] | None:
    if config_file is not None:
        return Path(config_file), "config_file"
    from_env = env.get(f"{ENV_PREFIX}CONFIG", "").strip()
    if from_env:
        return Path(from_env), f"{ENV_PREFIX}CONFIG"
    default = Path(DEFAULT_FILE)
    return (default, DEFAULT_FILE) if default.is_file() else None


def load_settings(
    overrides: Mapping[str, object] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> Settings:
    """Build validated ``Settings`` from overrides, the environment, a TOML file and defaults.

    ``env`` defaults to ``os.environ``; empty environment values count as unset. Unknown
    keys in ``overrides`` or the file are errors; unknown ``MESHFORGE_*`` variables are
    left alone (other parts of MeshForge read some).

    Example::

        settings = load_settings({"nats_url": "nats://127.0.0.1:4222"})
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    values: dict[str, Any] = {}

    located = _config_path(config_file, environ)
    if located is not None:
        path, label = located
        for key, raw in _read_file(path, label).items():
            values[key] = _parse(key, raw, f"{key} in {path}")

    for key in _PARSERS:
        name = f"{ENV_PREFIX}{key.upper()}"
        raw_env = environ.get(name)
        if raw_env is not None and raw_env.strip():
            values[key] = _parse(key, raw_env, name)

    for key, raw in (overrides or {}).items():
        if key not in _PARSERS:
            raise ConfigError(f"unknown setting {key!r}; known settings: {', '.join(_PARSERS)}")
        if raw is not None:
            values[key] = _parse(key, raw, key)

    settings = Settings(**values)
    _check_together(settings)
    return settings


def _parse(key: str, raw: object, label: str) -> object:
    return _parse_with(_PARSERS[key], raw, label, key)


def parse_setting(key: str, raw: object, label: str | None = None) -> Any:
    """One setting's value checked as ``load_settings`` checks it; ConfigError names ``label``.

    >>> parse_setting("connect_timeout", "2s")
    2.0
    """
    if key not in _PARSERS:
        raise ConfigError(f"unknown setting {key!r}; known settings: {', '.join(_PARSERS)}")
    return _parse(key, raw, label or key)


def load_auth(
    values: Mapping[str, object], *, prefix: str = "", names: Mapping[str, str] | None = None
) -> AuthSettings:
    """``AuthSettings`` from raw values by setting name, checked as ``load_settings`` checks
    them (each value, and the rules that tie them together); ``None`` or blank is unset.

    Errors start with ``prefix`` and call a setting by its name in ``names``, if there
    (the Spark options say ``jetstream: creds``).

    >>> load_auth({"user": " alice ", "password": "pw", "tls_ca": ""}).user
    'alice'
    """
    name = _namer(names)
    parsed: dict[str, Any] = {}
    for key in AUTH_FIELDS:
        raw = values.get(key)
        if raw is not None and not (isinstance(raw, str) and not raw.strip()):
            parsed[key] = _parse(key, raw, prefix + name(key))
    auth = AuthSettings(**parsed)
    _check_auth(auth, prefix, name)
    return auth


def _namer(names: Mapping[str, str] | None) -> Callable[[str], str]:
    return (lambda key: names.get(key, key)) if names else str


def redelivery_span(s: Settings) -> float:
    """The longest a command can keep being redelivered: every ack wait plus every backoff."""
    delays = list(s.backoff[: max(0, s.max_deliver - 1)])
    delays += [s.backoff[-1] if s.backoff else 0.0] * (max(0, s.max_deliver - 1) - len(delays))
    return s.max_deliver * s.ack_wait + sum(delays)


def _check_together(s: Settings) -> None:
    """Rules that tie two settings together (the server enforces some of them)."""
    if s.max_age and s.duplicate_window > s.max_age:
        raise ConfigError(
            f"duplicate_window: expected at most max_age ({s.max_age:g}s), got {s.duplicate_window:g}s"
        )
    span = redelivery_span(s)
    if s.effect_retention and s.effect_retention < max(s.duplicate_window, span):
        raise ConfigError(
            f"effect_retention: expected 0 (keep forever) or at least {max(s.duplicate_window, span):g}s"
            f" (the duplicate window, {s.duplicate_window:g}s, and the redelivery span, {span:g}s),"
            f" got {s.effect_retention:g}s"
        )
    if s.publish_backoff_cap < s.publish_backoff_base:
        raise ConfigError(
            f"publish_backoff_cap: expected at least publish_backoff_base "
            f"({s.publish_backoff_base:g}s), got {s.publish_backoff_cap:g}s"
        )
    _check_auth(s, "", str)


def _check_auth(s: AuthSettings, prefix: str, name: Callable[[str], str]) -> None:
    """The auth and TLS settings that go together (or not at all)."""
    if (s.tls_cert is None) != (s.tls_key is None):
        missing = "tls_key" if s.tls_key is None else "tls_cert"
        raise ConfigError(
            f"{prefix}{name(missing)}: expected a file path "
            f"({name('tls_cert')} and {name('tls_key')} go together), got None"
        )
    keys = ("creds_file", "nkey_seed", "nkey_seed_file")
    given = [n for n in keys if getattr(s, n) is not None]
    if len(given) > 1:
        raise ConfigError(
            f"{prefix}{name(given[1])}: expected only one of {', '.join(map(name, keys))}, "
            f"got {name(given[0])} as well"
        )
    if s.password is not None and s.user is None:
        raise ConfigError(
            f"{prefix}{name('user')}: expected a user name when {name('password')} is set, got None"
        )
