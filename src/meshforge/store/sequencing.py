"""Schema version 5: the layout written in sequence (docs/STORE.md).

Effects are a log: ``meshforge_effects`` gets a sequence (``seq``), each row is appended
in commit order and never changed again. Publishing progress is a log too:
``meshforge_published (first_seq, last_seq, published_at)`` gets one row for each run of
consecutive sequences a mark names, cut at multiples of ``RUN`` (1,024), so the runs
covering sequence ``s`` start between ``s - 1023`` and ``s``; a mark leaves out what a
run covers already, so an effect's ``published_at`` is the one run that covers it.

On SQLite what must be found again by a random key costs a narrow index row: the key of
an effect, the id of an event and the resource of a state are found through a 64-bit
digest column (``kd``, ``ed``, ``sd``: BLAKE2b of tenant, namespace, owner and name, each
framed by its length, so no two tuples join into the same bytes) with an index of its
own, and every lookup compares the rows it finds with the names themselves, so two names
with one digest are told apart. SQLite has one writer (``BEGIN IMMEDIATE``): a key
looked up absent stays absent until the same transaction stores it, so the store checks
before it inserts. PostgreSQL, where concurrent workers need the database to enforce
the key, keeps its unique indexes and gets only the sequence and the published runs.

The migration rebuilds ``meshforge_effects`` (rows in stored order: ``created_at``,
then the old key, numbered from 1), turns each stored ``published_at`` into runs, and on
SQLite rebuilds the events and states with their digest columns. Like every migration it
runs in one transaction under the migration lock: stopped anywhere, it leaves the
schema-4 store as it was and runs again from its start on the next open.
"""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b
from typing import TYPE_CHECKING

from meshforge.errors import StoreError, one_line

if TYPE_CHECKING:
    from meshforge.store.scoping import Step
    from meshforge.store.sql import Dialect, Runner

#: Published runs never cross a multiple of this: the runs covering ``s`` start in
#: ``[s - RUN + 1, s]``, one index range to read.
RUN = 1024

#: The SQL function (SQLite) the migration computes digest columns with.
DIGEST_FUNCTION = "meshforge_digest"

# The run covering effect ``e``, read through the runs' index backwards from ``e.seq``:
# marks never cover a sequence twice (``LAST_RUN_END``), so the latest run to start at or
# before it is the one that covers it when any does, and a published effect costs one
# index step. (Scanning forwards, or asking for the earliest of the runs that cover it,
# reads every run of the 1,024 sequences before it: hundreds when a light load marks
# a few effects at a time.) An unpublished effect reads the runs of that range.
_COVERING = (
    f" FROM meshforge_published p WHERE p.first_seq BETWEEN e.seq - {RUN - 1} AND e.seq"
    " AND p.last_seq >= e.seq ORDER BY p.first_seq DESC LIMIT 1"
)
PUBLISHED_AT = f"(SELECT p.published_at{_COVERING})"
# (Not EXISTS: SQLite drops the ORDER BY of an EXISTS subquery, and scans forwards.)
IS_PUBLISHED = f"{PUBLISHED_AT} IS NOT NULL"
#: The end of the latest run to start at or before sequence ``column1`` (one index step):
#: the sequence is covered when that end reaches it. A mark leaves out what is covered,
#: so no sequence is covered twice (on PostgreSQL, two transactions marking the same
#: effect at once could still both cover it; it reads as the later-starting run's time).
LAST_RUN_END = (
    "(SELECT p.last_seq FROM meshforge_published p WHERE p.first_seq <= {seq}"
    " ORDER BY p.first_seq DESC LIMIT 1)"
)


def _frame(text: str) -> bytes:
    data = text.encode()
    return len(data).to_bytes(8, "little") + data


def digests(tenant: str, namespace: str, owner: str, names: Iterable[str]) -> list[int]:
    """The 64-bit digests (signed, as SQLite's INTEGER holds them) of ``names`` of one
    scope and owner (a consumer's keys, an agent's event ids or resources). Text no
    database can store (a lone surrogate) is ``StoreError(kind="invalid")``, as binding
    it would be."""
    try:
        head = blake2b(_frame(tenant) + _frame(namespace) + _frame(owner), digest_size=8)
        out: list[int] = []
        for name in names:
            h = head.copy()
            h.update(_frame(name))
            out.append(int.from_bytes(h.digest(), "little", signed=True))
    except UnicodeEncodeError as exc:
        raise StoreError(f"sqlite store: {one_line(exc)}", kind="invalid") from exc
    return out


def digest(tenant: str, namespace: str, owner: str, name: str) -> int:
    """The digest of one name (``digests`` of one, looked up at each call); the SQL
    function ``DIGEST_FUNCTION`` the migration fills digest columns with."""
    return digests(tenant, namespace, owner, [name])[0]


def runs(seqs: Iterable[int]) -> list[tuple[int, int]]:
    """The runs of consecutive sequences among ``seqs``, cut at multiples of ``RUN``.

    Example: ``runs([5, 3, 4, 9, 1023, 1024])`` is
    ``[(3, 5), (9, 9), (1023, 1023), (1024, 1024)]``.
    """
    out: list[tuple[int, int]] = []
    for s in sorted(set(seqs)):
        if out and s == out[-1][1] + 1 and s % RUN:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


# Numbering of the old rows: the order they were stored in (the old key breaks ties).
_STORED_ORDER = "row_number() OVER (ORDER BY created_at, tenant, namespace, consumer, key)"

_RUNS_FROM_OLD = f"""
INSERT INTO meshforge_published (first_seq, last_seq, published_at)
SELECT min(seq), max(seq), published_at FROM (
    SELECT seq, published_at,
        seq - row_number() OVER (PARTITION BY published_at ORDER BY seq) AS island
    FROM (SELECT {_STORED_ORDER} AS seq, published_at FROM meshforge_effects) n
    WHERE published_at IS NOT NULL) m
GROUP BY published_at, island, seq / {RUN}"""

_EFFECT_COLUMNS = "tenant, namespace, consumer, key, command_id, created_at, outputs"


def _create_log(run: Runner, dialect: Dialect) -> None:
    digest_column = "kd INTEGER NOT NULL, " if dialect.name == "sqlite" else ""
    run.rows(
        dialect.ddl(
            f"""CREATE TABLE meshforge_effects_v5 (
            seq {{id}}, {digest_column}tenant TEXT NOT NULL, namespace TEXT NOT NULL,
            consumer TEXT NOT NULL, key TEXT NOT NULL, command_id TEXT NOT NULL,
            created_at {{ts}} NOT NULL, outputs {{blob}})"""
        )
    )


def _copy_effects(run: Runner, dialect: Dialect) -> None:
    """The old rows numbered in stored order, appended in that order (SQLite: with the
    digest of their key)."""
    sqlite = dialect.name == "sqlite"
    digest_value = f"{DIGEST_FUNCTION}(tenant, namespace, consumer, key), " if sqlite else ""
    run.rows(
        f"INSERT INTO meshforge_effects_v5 (seq, {'kd, ' if sqlite else ''}{_EFFECT_COLUMNS})"
        f" SELECT {_STORED_ORDER} AS seq, {digest_value}{_EFFECT_COLUMNS}"
        " FROM meshforge_effects ORDER BY seq"
    )


def _create_published(run: Runner, dialect: Dialect) -> None:
    run.rows(
        dialect.ddl(
            """CREATE TABLE meshforge_published (
            first_seq BIGINT NOT NULL, last_seq BIGINT NOT NULL, published_at {ts} NOT NULL,
            PRIMARY KEY (first_seq, last_seq, published_at))"""
        )
        + (" WITHOUT ROWID" if dialect.name == "sqlite" else "")
    )


def _key_index(run: Runner, dialect: Dialect) -> None:
    """SQLite: the digest index; PostgreSQL: the unique key, and the identity set past the
    numbers the copy gave (``setval`` of none does nothing)."""
    if dialect.name == "sqlite":
        run.rows("CREATE INDEX meshforge_effects_kd ON meshforge_effects (kd)")
        return
    run.rows(
        "CREATE UNIQUE INDEX meshforge_effects_key"
        " ON meshforge_effects (tenant, namespace, consumer, key)"
    )
    run.rows(
        "SELECT setval(pg_get_serial_sequence('meshforge_effects', 'seq'), max(seq))"
        " FROM meshforge_effects"
    )
    # The primary key and the identity's sequence named after the table, not its copy.
    run.rows("ALTER INDEX meshforge_effects_v5_pkey RENAME TO meshforge_effects_pkey")
    [(sequence,)] = run.rows("SELECT pg_get_serial_sequence('meshforge_effects', 'seq')")
    run.rows(f"ALTER SEQUENCE {sequence} RENAME TO meshforge_effects_seq_seq")


_EVENT_COLUMNS = (
    "tenant, namespace, agent, position, event_id, type, resource_id, command_id, key, data,"
    " ts, stored_at"
)
_STATE_COLUMNS = "tenant, namespace, agent, resource_id, data, position, updated_at"


def _with_digest(run: Runner, table: str, ddl: str, column: str, columns: str, name: str) -> None:
    """SQLite: ``meshforge_<table>`` rebuilt from ``ddl`` (its columns) with the digest
    ``column`` of each row's tenant, namespace, agent and ``name``, and an index on it."""
    full = f"meshforge_{table}"
    run.rows(f"CREATE TABLE {full}_v5 ({ddl})")
    run.rows(
        f"INSERT INTO {full}_v5 ({column}, {columns})"
        f" SELECT {DIGEST_FUNCTION}(tenant, namespace, agent, {name}), {columns}"
        f" FROM {full} ORDER BY rowid"
    )
    run.rows(f"DROP TABLE {full}")
    run.rows(f"ALTER TABLE {full}_v5 RENAME TO {full}")
    run.rows(f"CREATE INDEX {full}_{column} ON {full} ({column})")


def _narrow_events(run: Runner, dialect: Dialect) -> None:
    """SQLite: event ids found through a digest index (``ed``), not a unique index."""
    if dialect.name == "sqlite":
        _with_digest(run, "events", """tenant TEXT NOT NULL, namespace TEXT NOT NULL,
            agent TEXT NOT NULL, position BIGINT NOT NULL, ed INTEGER NOT NULL,
            event_id TEXT NOT NULL, type TEXT NOT NULL, resource_id TEXT,
            command_id TEXT NOT NULL, key TEXT NOT NULL, data BLOB NOT NULL, ts TEXT NOT NULL,
            stored_at TEXT NOT NULL, PRIMARY KEY (tenant, namespace, agent, position)""",
            "ed", _EVENT_COLUMNS, "event_id")  # fmt: skip


def _narrow_states(run: Runner, dialect: Dialect) -> None:
    """SQLite: resources found through a digest index (``sd``); rows changed in place."""
    if dialect.name == "sqlite":
        _with_digest(run, "states", """sd INTEGER NOT NULL, tenant TEXT NOT NULL,
            namespace TEXT NOT NULL, agent TEXT NOT NULL, resource_id TEXT NOT NULL,
            data BLOB NOT NULL, position BIGINT NOT NULL, updated_at TEXT NOT NULL""",
            "sd", _STATE_COLUMNS, "resource_id")  # fmt: skip


STEPS: list[Step] = [
    _create_log,
    _copy_effects,
    _create_published,
    _RUNS_FROM_OLD,
    "DROP TABLE meshforge_effects",
    "ALTER TABLE meshforge_effects_v5 RENAME TO meshforge_effects",
    _key_index,
    "CREATE INDEX meshforge_effects_created ON meshforge_effects (created_at)",
    _narrow_events,
    _narrow_states,
]
