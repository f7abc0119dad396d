"""The SQL core both backends share: the dialect, a statement runner, value codecs.

All SQL in the store is written once with ``?`` placeholders; a ``Dialect`` says how one
database differs (placeholder style, column types, row locking, timestamps, errors).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, Literal, Protocol

from meshforge.errors import ConfigError, StoreError, one_line

_SQLITE_TS = "%Y-%m-%dT%H:%M:%S.%fZ"
# Values a driver refuses to bind before the database sees them: deterministic per value.
_UNBINDABLE: tuple[type[Exception], ...] = (UnicodeError, OverflowError)


class Cursor(Protocol):
    """The part of a DB-API cursor the store uses."""

    @property
    def description(self) -> Any: ...

    @property
    def rowcount(self) -> int: ...

    def execute(self, sql: Any, params: Any = ..., /) -> Any: ...

    def fetchall(self) -> Sequence[Any]: ...


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one database spells the store's SQL."""

    name: Literal["sqlite", "postgresql"]
    types: Mapping[str, str]
    ts_in: Callable[[datetime], Any]
    ts_out: Callable[[Any], datetime]
    to_store_error: Callable[[Exception], StoreError]
    driver_errors: tuple[type[Exception], ...]
    translate: Callable[[str], str] = field(default=lambda sql: sql)
    # Suffixes and statements that only mean something where rows can be locked.
    for_update: str = ""
    skip_locked: str = ""
    resource_lock: str | None = None
    migration_lock: str | None = None

    def ddl(self, template: str) -> str:
        """A DDL template with the dialect's column types filled in."""
        return template.format(**self.types)

    def sql(self, sql: str) -> str:
        """A ``?``-style statement in the driver's placeholder style."""
        return self.translate(sql)


@lru_cache(maxsize=512)
def qmark_to_format(sql: str) -> str:
    """``?`` placeholders to ``%s`` (outside quotes), ``%`` doubled, for psycopg.

    Example: ``qmark_to_format("a LIKE 'x%' AND b = ?")`` is ``"a LIKE 'x%%' AND b = %s"``.
    """
    out: list[str] = []
    quote: str | None = None
    for char in sql:
        if char == "%":
            out.append("%%")
            continue
        if quote is not None:
            if char == quote:
                quote = None
        elif char in ("'", '"'):
            quote = char
        elif char == "?":
            out.append("%s")
            continue
        out.append(char)
    return "".join(out)


def utc(value: datetime) -> datetime:
    """The instant in UTC; a naive datetime is taken to be UTC already."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def sqlite_ts_in(value: datetime) -> str:
    """Fixed-width UTC text, so SQLite compares timestamps as strings correctly."""
    return utc(value).strftime(_SQLITE_TS)


def sqlite_ts_out(value: Any) -> datetime:
    # fromisoformat reads the fixed-width "...Z" form fifty times faster than strptime.
    return datetime.fromisoformat(str(value)).astimezone(UTC)


def ts_or_none(dialect: Dialect, value: Any) -> datetime | None:
    return None if value is None else dialect.ts_out(value)


def dump_headers(headers: Mapping[str, str]) -> str:
    """Headers as compact JSON text; every key and value must be a string."""
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise StoreError(
                f"headers must map str to str: {name!r} has {type(value).__name__} {value!r}"
            )
    return json.dumps(dict(headers), separators=(",", ":"), sort_keys=True)


def load_headers(text: Any) -> dict[str, str]:
    if not text:
        return {}
    loaded = json.loads(text)
    return {str(k): str(v) for k, v in loaded.items()}


def clean_text(text: str, limit: int = 4096) -> str:
    """Error text safe for any TEXT column: no NUL, one line, bounded."""
    return text.replace("\x00", " ").replace("\r", " ").replace("\n", " ")[:limit]


class Runner:
    """Runs the store's SQL on one cursor inside one open transaction.

    A driver error becomes a ``StoreError`` and spoils the transaction (``failed``), so
    both backends behave alike after an error (PostgreSQL aborts the transaction anyway).
    """

    def __init__(self, dialect: Dialect, cursor: Cursor) -> None:
        self.dialect = dialect
        self.failed = False
        self._cursor = cursor

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Execute one statement; its result rows, or [] when it returns none."""
        cursor = self._start(sql, params)
        try:
            if cursor.description is None:
                return []
            return [tuple(row) for row in cursor.fetchall()]
        except self.dialect.driver_errors as exc:
            self.failed = True
            raise self.dialect.to_store_error(exc) from exc

    def count(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Execute one statement; how many rows it changed."""
        return max(self._start(sql, params).rowcount, 0)

    def _start(self, sql: str, params: Sequence[Any]) -> Cursor:
        if self.failed:
            raise StoreError(
                f"{self.dialect.name} store: the transaction already failed and will roll back",
                kind="error",
            )
        try:
            self._cursor.execute(self.dialect.sql(sql), tuple(params))
        except self.dialect.driver_errors as exc:
            self.failed = True
            raise self.dialect.to_store_error(exc) from exc
        except _UNBINDABLE as exc:
            # The driver could not even send the value (lone surrogate, huge integer).
            self.failed = True
            raise StoreError(f"{self.dialect.name} store: {one_line(exc)}", kind="invalid") from exc
        return self._cursor


def in_clause(count: int) -> str:
    """``(?, ?, ...)`` with ``count`` placeholders."""
    return "(" + ", ".join("?" * count) + ")"


EXPECTED_URLS = (
    "expected sqlite:///relative/path.db, sqlite:////absolute/path.db, sqlite:///:memory:"
    " or postgresql://user@host:5432/database"
)


def redact(url: str) -> str:
    """The URL with any password replaced by ``***``, fit for messages and logs."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, host = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"


def url_error(url: str, reason: str) -> ConfigError:
    """The one-line error for a store URL that cannot be used."""
    return ConfigError(f"store URL {redact(url)!r}: {reason}; {EXPECTED_URLS}")
