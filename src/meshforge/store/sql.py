"""The SQL core both backends share: the dialect, a statement runner, value codecs.

All SQL in the store is written once with ``?`` placeholders; a ``Dialect`` says how one
database differs (placeholder style, column types, row locking, timestamps, errors).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from itertools import chain
from typing import Any, Concatenate, Literal, ParamSpec, Protocol, TypeVar

import msgspec

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

    def executemany(self, sql: Any, params_seq: Any, /) -> Any: ...

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
    # The same lock on many resources in one statement: one ``?``, an array of their names.
    resources_lock: str | None = None
    migration_lock: str | None = None
    # Bound parameters one statement may carry (multi-row writes are chunked below it).
    max_params: int = 999
    # Fast paths where the driver has them: ``copy_in(cursor, "table (col, ...)", rows)``
    # loads rows with one COPY; ``arrays`` binds a key list as one array per column.
    copy_in: Callable[[Cursor, str, Sequence[Sequence[Any]]], None] | None = None
    arrays: bool = False
    # Execute planned for these values, never from a cached plan (joins over key lists).
    execute_fresh: Callable[[Cursor, str, Sequence[Any]], None] | None = None
    # In process (SQLite). A statement costs no round trip, but each of its steps gives
    # Python's GIL up and takes it back, which costs far more than the step itself while
    # the event loop is busy: many rows go in few multi-row statements, of few shapes
    # (``chunk_sizes``), each prepared once. A failed statement undoes only itself; the
    # transaction goes on.
    embedded: bool = False

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


# One encoder for every call: ``json.dumps`` with options builds a new one each time.
_encode_headers = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode
_SORTED_JSON = msgspec.json.Encoder(order="sorted")
_HEADERS = msgspec.json.Decoder(dict[str, str])
_JUST_STR = frozenset({str})


def dump_headers(headers: Mapping[str, str]) -> str:
    """Headers as compact JSON text, names sorted; every key and value must be a string."""
    return headers_json(headers).decode()


def headers_json(headers: Mapping[str, str]) -> bytes:
    """``dump_headers`` as UTF-8 bytes (what a packed value holds)."""
    if not _JUST_STR.issuperset(map(type, chain(headers, headers.values()))):  # one C pass
        for name, value in headers.items():
            if not isinstance(name, str) or not isinstance(value, str):
                raise StoreError(
                    f"headers must map str to str: {name!r} has {type(value).__name__} {value!r}"
                )
    plain = headers if type(headers) is dict else dict(headers)
    try:
        return _SORTED_JSON.encode(plain)
    except UnicodeEncodeError:  # a lone surrogate: only the escaping encoder can write it
        return _encode_headers(plain).encode()


def load_headers(text: Any) -> dict[str, str]:
    """The headers ``dump_headers`` wrote (read at C speed); other JSON objects have their
    keys and values made strings."""
    if not text:
        return {}
    try:
        return _HEADERS.decode(text)
    except (msgspec.DecodeError, TypeError):  # written by other means: non-text values
        loaded = json.loads(text)
        return {str(k): str(v) for k, v in loaded.items()}


def clean_text(text: str, limit: int = 4096) -> str:
    """Error text safe for any TEXT column: no NUL, one line, bounded."""
    return text.replace("\x00", " ").replace("\r", " ").replace("\n", " ")[:limit]


# Rows per multi-row statement at most: keeps statement text and planning small.
_MAX_ROWS = 500
# Below this many rows (a power of two), a multi-row write of an ``embedded`` dialect is
# one statement of just that size.
_EXACT = 8


class Runner:
    """Runs the store's SQL on one cursor inside one open transaction.

    A driver error becomes a ``StoreError`` and spoils the transaction (``failed``), so
    both backends behave alike after an error (PostgreSQL aborts the transaction anyway).
    """

    def __init__(self, dialect: Dialect, cursor: Cursor) -> None:
        self.dialect = dialect
        self.failed = False
        self._cursor = cursor

    def rows(
        self, sql: str, params: Sequence[Any] = (), *, fresh: bool = False
    ) -> list[tuple[Any, ...]]:
        """Execute one statement; its result rows, or [] when it returns none. ``fresh``:
        plan it for these values, not from a plan cached for the statement."""
        cursor = self._start(sql, params, fresh=fresh)
        try:
            if cursor.description is None:
                return []
            return [tuple(row) for row in cursor.fetchall()]
        except self.dialect.driver_errors as exc:
            self.failed = True
            raise self.dialect.to_store_error(exc) from exc

    def count(
        self, sql: str, params: Sequence[Any] = (), *, fresh: bool = False, spoil: bool = True
    ) -> int:
        """Execute one statement; how many rows it changed. ``spoil=False``: where the
        dialect is ``embedded``, its failure leaves the transaction usable."""
        return max(self._start(sql, params, fresh=fresh, spoil=spoil).rowcount, 0)

    def insert(self, target: str, rows: Sequence[Sequence[Any]]) -> None:
        """Insert ``rows`` into ``target`` (``"table (col, ...)"``): one COPY where the
        driver has it (several times cheaper than binding every value), else multi-row
        INSERTs."""
        copy_in = self.dialect.copy_in
        if not rows:
            return
        if copy_in is None:
            self.each(f"INSERT INTO {target} VALUES {{rows}}", rows)
            return
        with self._sending():
            copy_in(self._cursor, target, rows)

    def each(
        self, sql: str, rows: Sequence[Sequence[Any]], fixed: Sequence[Any] = ()
    ) -> list[tuple[Any, ...]]:
        """Run ``sql`` for all ``rows`` (after the ``fixed`` parameters) in as few statements
        as the parameter limit allows; every row they return.

        In ``sql``, ``{rows}`` stands for ``(?, ...), (?, ...)``; ``{keys}`` for a table of
        the rows (all text) with columns ``column1``, ``column2``, ...: bound as one array
        per column where the dialect has ``arrays`` (one statement whatever the size).
        Join it to the table it names rows of: a join probes the primary key once a key
        on every backend and with any statistics, where ``= ANY`` or ``IN`` may scan. Such
        a statement is planned afresh on every execution (``Dialect.execute_fresh``).

        Example: ``run.each("INSERT INTO t (a, b) VALUES {rows}", [(1, "x"), (2, "y")])``
        """
        fresh = "{keys}" in sql
        chunks = self._chunks(sql, rows, fixed)
        return [row for text, params, _ in chunks for row in self.rows(text, params, fresh=fresh)]

    def each_count(self, sql: str, rows: Sequence[Sequence[Any]], fixed: Sequence[Any] = ()) -> int:
        """Like ``each`` for a statement that changes rows: how many it changed in all."""
        fresh = "{keys}" in sql
        chunks = self._chunks(sql, rows, fixed)
        return sum(self.count(text, params, fresh=fresh) for text, params, _ in chunks)

    def statements(
        self, sql: str, rows: Sequence[Sequence[Any]], fixed: Sequence[Any] = ()
    ) -> list[tuple[str, list[Any], Sequence[Sequence[Any]]]]:
        """The statements ``each`` runs for these rows (``?`` style, with their parameters,
        and the rows each carries), for a caller that sends them its own way."""
        return list(self._chunks(sql, rows, fixed))

    def many(self, sql: str, rows: Iterable[Sequence[Any]]) -> int:
        """Execute the single-row statement ``sql`` once for every row, prepared once; how
        many rows it changed in all. ``rows`` is consumed in order, one row at a time."""
        with self._sending():
            self._cursor.executemany(self.dialect.sql(sql), rows)
        return max(self._cursor.rowcount, 0)

    def _chunks(
        self, sql: str, rows: Sequence[Sequence[Any]], fixed: Sequence[Any]
    ) -> Iterator[tuple[str, list[Any], Sequence[Sequence[Any]]]]:
        if not rows:
            return
        width = len(rows[0])
        if "{keys}" in sql:
            if self.dialect.arrays:
                arrays = ", ".join(["?::text[]"] * width)
                names = ", ".join(f"column{n}" for n in range(1, width + 1))
                source = f"SELECT * FROM unnest({arrays}) AS k({names})"
                arrays_of = [*fixed, *map(list, zip(*rows, strict=True))]
                yield sql.replace("{keys}", source), arrays_of, rows
                return
            sql = sql.replace("{keys}", "VALUES {rows}")
        per = max(1, min(_MAX_ROWS, (self.dialect.max_params - len(fixed)) // width))
        start = 0
        for size in chunk_sizes(len(rows), per, shapes=self.dialect.embedded):
            chunk = rows[start : start + size]
            start += size
            yield _with_rows(sql, width, size), [*fixed, *chain.from_iterable(chunk)], chunk

    def _ensure_open(self) -> None:
        if self.failed:
            raise StoreError(
                f"{self.dialect.name} store: the transaction already failed and will roll back",
                kind="error",
            )

    def _start(
        self, sql: str, params: Sequence[Any], *, fresh: bool = False, spoil: bool = True
    ) -> Cursor:
        with self._sending(spoil=spoil):
            if fresh and self.dialect.execute_fresh is not None:
                self.dialect.execute_fresh(self._cursor, self.dialect.sql(sql), tuple(params))
            else:
                self._cursor.execute(self.dialect.sql(sql), tuple(params))
        return self._cursor

    @contextmanager
    def _sending(self, *, spoil: bool = True) -> Iterator[None]:
        """Around one call into the driver: a failed transaction refuses it, and a driver
        error fails the transaction (unless ``spoil`` is false and the dialect
        ``embedded``: then only the statement failed) and becomes a ``StoreError``."""
        self._ensure_open()
        try:
            yield
        except self.dialect.driver_errors as exc:
            self.failed = spoil or not self.dialect.embedded
            raise self.dialect.to_store_error(exc) from exc
        except _UNBINDABLE as exc:
            # The driver could not even send the value (lone surrogate, huge integer).
            self.failed = True
            raise StoreError(f"{self.dialect.name} store: {one_line(exc)}", kind="invalid") from exc


class _HasRunner(Protocol):
    _run: Runner


H = TypeVar("H", bound=_HasRunner)
P = ParamSpec("P")
R = TypeVar("R")


def spoils(method: Callable[Concatenate[H, P], R]) -> Callable[Concatenate[H, P], R]:
    """Any StoreError from the method spoils the transaction, on every backend alike."""

    @functools.wraps(method)
    def wrapper(self: H, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except StoreError:
            self._run.failed = True
            raise

    return wrapper


def chunk_sizes(total: int, per: int, *, shapes: bool = False) -> list[int]:
    """How many rows each statement of a multi-row write of ``total`` rows carries: at
    most ``per``. With ``shapes``, the rest after the whole chunks goes in powers of two
    from ``_EXACT`` up and what remains below it in one statement, so a statement has
    one of a few texts however many rows come (each prepared once), and a small write
    (a light load's) is one statement.

    Example: ``chunk_sizes(1100, 500, shapes=True)`` is ``[500, 500, 64, 32, 4]``.
    """
    whole, rest = divmod(total, per)
    sizes = [per] * whole
    if shapes:
        bits = range(_EXACT.bit_length() - 1, rest.bit_length())
        sizes += [1 << bit for bit in reversed(bits) if rest >> bit & 1]
        rest &= _EXACT - 1
    return [*sizes, rest] if rest else sizes


@lru_cache(maxsize=1024)
def _with_rows(sql: str, width: int, count: int) -> str:
    """``sql`` with ``{rows}`` as ``count`` groups of ``width`` placeholders."""
    return sql.replace("{rows}", ", ".join([in_clause(width)] * count))


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
