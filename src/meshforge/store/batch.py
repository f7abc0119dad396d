"""The batch methods of ``SqlTransaction``: many states and effects in one statement each.

A batch of commands costs a handful of statements instead of several per command, which
is what a networked database (one round trip per statement) needs. Rows are named by
``(scope, id)`` pairs and matched with a join over a table of them, which both dialects
plan as primary-key lookups; lists past the parameter limit are chunked. On SQLite, where
a statement costs no round trip but each bound value several hundred instructions, a
statement takes one scope: what its rows share (tenant, namespace, agent or consumer,
time) is bound once. There (schema 5, ``meshforge.store.sequencing``) keys, event ids and
resources are found through a 64-bit digest column and its index (``kd IN (VALUES ...)``),
and the rows found are kept only if their own name is one asked for: two names with one
digest are told apart. The transaction remembers the effect keys it found absent and the
rows of the resources it read, so its writes need not look them up again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from meshforge.errors import StoreError
from meshforge.store import sequencing
from meshforge.store.base import NewEffect, NewState, Scoped, StoredOutput
from meshforge.store.packing import pack_outputs, unpack_outputs
from meshforge.store.sql import Dialect, Runner, spoils
from meshforge.topology.scope import Scope

# A name of one scope and owner: (consumer, scope, key) or (agent, scope, resource id).
Owned = tuple[str, Scope, str]

# The batch statements a backend may also send its own way (``meshforge.store.postgres``).
# Each joins a ``{keys}`` table of (tenant, namespace, agent or consumer, id) rows.
STATES_GET = (
    "SELECT s.tenant, s.namespace, s.resource_id, s.data FROM ({keys}) AS u"
    " JOIN meshforge_states s ON s.tenant = u.column1 AND s.namespace = u.column2"
    " AND s.agent = u.column3 AND s.resource_id = u.column4"
)
EFFECTS_GET = (
    "SELECT e.tenant, e.namespace, e.key, e.outputs FROM ({keys}) AS u"
    " JOIN meshforge_effects e ON e.tenant = u.column1 AND e.namespace = u.column2"
    " AND e.consumer = u.column3 AND e.key = u.column4"
)
# Marking published appends one run a stretch of consecutive sequences (cut at multiples
# of ``sequencing.RUN``); what it returns is how many effects it found. Nothing stored is
# rewritten. The time comes first, as ``Runner.each`` binds its fixed values first.
EFFECTS_MARK_PUBLISHED = f"""
WITH found AS (
    SELECT e.seq, ?::timestamptz AS at FROM ({{keys}}) AS u
    JOIN meshforge_effects e ON e.tenant = u.column1 AND e.namespace = u.column2
    AND e.consumer = u.column3 AND e.key = u.column4
), fresh AS (
    SELECT seq, at FROM found
    WHERE COALESCE({sequencing.LAST_RUN_END.format(seq="found.seq")} < found.seq, true)
), marked AS (
    INSERT INTO meshforge_published (first_seq, last_seq, published_at)
    SELECT min(seq), max(seq), min(at) FROM (
        SELECT seq, at, seq - row_number() OVER (ORDER BY seq) AS island FROM fresh) m
    GROUP BY island, seq / {sequencing.RUN} ON CONFLICT DO NOTHING
) SELECT count(*) FROM found"""

# The same for SQLite, one scope a statement: what every row shares is bound once (each
# value bound costs the sqlite3 module several hundred instructions), and the rows are
# found by their digest; the name comes first, to be compared with the names asked.
# (INDEXED BY: the digest index, whatever the planner guesses of the others.)
_STATES_GET_ONE_SCOPE = (
    "SELECT resource_id, rowid, data FROM meshforge_states INDEXED BY meshforge_states_sd"
    " WHERE tenant = ? AND namespace = ? AND agent = ? AND sd IN (VALUES {rows})"
)
_EFFECTS_GET_ONE_SCOPE = (
    "SELECT key, outputs FROM meshforge_effects INDEXED BY meshforge_effects_kd"
    " WHERE tenant = ? AND namespace = ? AND consumer = ? AND kd IN (VALUES {rows})"
)
_EFFECT_SEQS_ONE_SCOPE = (
    "SELECT key, seq FROM meshforge_effects INDEXED BY meshforge_effects_kd"
    " WHERE tenant = ? AND namespace = ? AND consumer = ? AND kd IN (VALUES {rows})"
)
_EFFECTS_PUT_ONE_SCOPE = (
    "INSERT INTO meshforge_effects (tenant, namespace, consumer, key, kd, command_id,"
    " created_at, outputs) SELECT ?, ?, ?, column1, column2, column3, ?, column4"
    " FROM (VALUES {rows})"
)
# The sequences asked that no run covers yet (``sequencing.LAST_RUN_END``).
_UNCOVERED = (
    "SELECT column1 FROM (VALUES {rows}) WHERE"
    f" COALESCE({sequencing.LAST_RUN_END.format(seq='column1')} < column1, 1)"
)
# (WHERE true: SQLite reads an ON after FROM as a join's unless a WHERE comes first.)
_RUNS_PUT = (
    "INSERT INTO meshforge_published (first_seq, last_seq, published_at)"
    " SELECT column1, column2, ? FROM (VALUES {rows}) WHERE true ON CONFLICT DO NOTHING"
)
_STATES_UPDATE = (
    "UPDATE meshforge_states SET data = u.column2, position = u.column3, updated_at = ?"
    " FROM (VALUES {rows}) AS u WHERE meshforge_states.rowid = u.column1"
)
_STATES_INSERT = (
    "INSERT INTO meshforge_states (tenant, namespace, agent, sd, resource_id, data, position,"
    " updated_at) SELECT ?, ?, ?, column1, column2, column3, column4, ? FROM (VALUES {rows})"
)


def _names_by_scope(pairs: Iterable[Scoped]) -> dict[Scope, list[str]]:
    """The names of ``pairs`` by their scope, in their order."""
    grouped: dict[Scope, list[str]] = {}
    for scope, name in pairs:
        grouped.setdefault(scope, []).append(name)
    return grouped


def lock_names(agent: str, slots: Iterable[Scoped]) -> list[str]:
    """The names ``Dialect.resources_lock`` locks the agent's resources by."""
    return [f"{s.tenant}\x1f{s.namespace}\x1f{agent}\x1f{r}" for s, r in slots]


class BatchMethods:
    """``states_get``/``put``, ``effects_get``/``put``/``mark_published``; see ``base``."""

    _run: Runner
    _d: Dialect
    _now: Any
    _blob: Callable[[Any], Any]  # a blob as this dialect binds it fastest (``SqlTransaction``)
    # SQLite: the effect keys this transaction found absent (still absent until it stores
    # them: one writer at a time), and the rowid of each resource it read (None: absent).
    _absent: set[Owned]
    _state_rows: dict[Owned, int | None]

    def _by_digest(
        self,
        sql: str,
        scope: Scope,
        owner: str,
        names: Sequence[str],
        found: Sequence[int] | None = None,
    ) -> list[tuple[Any, ...]]:
        """SQLite: the rows ``sql`` finds for ``names`` of one scope and owner by their
        digests (``found``, if the caller has them already; ``sql`` binds tenant,
        namespace and owner, then ``{rows}`` of digests, and selects the name first); a row
        whose name is not among ``names`` shares a digest with one of them and is left out."""
        if not names:
            return []
        if found is None:
            found = sequencing.digests(scope.tenant, scope.namespace, owner, names)
        rows = self._run.each(
            sql, [(d,) for d in dict.fromkeys(found)], (scope.tenant, scope.namespace, owner)
        )
        wanted = set(names)
        return [r for r in rows if r[0] in wanted]

    @spoils
    def states_get(self, agent: str, resources: Iterable[Scoped]) -> dict[Scoped, bytes | None]:
        slots = sorted(set(resources))
        found: dict[Scoped, bytes | None] = dict.fromkeys(slots)
        if not slots:
            return found
        if self._d.resources_lock:
            # Serialises workers on each resource even before its first snapshot exists.
            self._run.rows(self._d.resources_lock, (lock_names(agent, slots),))
        if self._d.embedded:
            for scope, names in _names_by_scope(slots).items():
                rows = self._by_digest(_STATES_GET_ONE_SCOPE, scope, agent, names)
                known = self._state_rows
                for name in names:
                    known[(agent, scope, name)] = None
                for resource_id, rowid, data in rows:
                    found[(scope, resource_id)] = bytes(data)
                    known[(agent, scope, resource_id)] = int(rowid)
            return found
        rows = self._run.each(
            STATES_GET + (self._d.for_update + " OF s" if self._d.for_update else ""),
            [(s.tenant, s.namespace, agent, r) for s, r in slots],
        )
        for tenant, namespace, resource_id, data in rows:
            found[(Scope(tenant, namespace), resource_id)] = bytes(data)
        return found

    @spoils
    def states_put(self, agent: str, states: Sequence[NewState]) -> None:
        # One row per resource: an upsert may not touch the same row twice.
        last = list({(s.scope, s.resource_id): s for s in states}.values())
        if not last:
            return
        upsert = (
            " ON CONFLICT (tenant, namespace, agent, resource_id) DO UPDATE"
            " SET data = excluded.data, position = excluded.position,"
            " updated_at = excluded.updated_at"
        )
        columns = (
            "meshforge_states (tenant, namespace, agent, resource_id, data, position, updated_at)"
        )
        if self._d.arrays:
            # Five arrays instead of seven values a row: far less to bind.
            self._run.rows(
                f"INSERT INTO {columns} SELECT t, n, ?, r, d, p, ? FROM unnest(?::text[],"
                " ?::text[], ?::text[], ?::bytea[], ?::bigint[]) AS u(t, n, r, d, p)" + upsert,
                (agent, self._now, [s.scope.tenant for s in last], [s.scope.namespace for s in last],
                 [s.resource_id for s in last], [bytes(s.data) for s in last],
                 [s.position for s in last]),
            )  # fmt: skip
            return
        blob = self._blob
        if self._d.embedded:
            self._states_put_embedded(agent, last)
            return
        rows = [(s.scope.tenant, s.scope.namespace, agent, s.resource_id, blob(s.data),
                 s.position, self._now) for s in last]  # fmt: skip
        self._run.each(f"INSERT INTO {columns} VALUES {{rows}}" + upsert, rows)

    def _states_put_embedded(self, agent: str, last: Sequence[NewState]) -> None:
        """``states_put`` for SQLite: a known resource's row changed in place by its rowid,
        a new one appended; a scope's tenant and namespace, the agent and the time bound
        once a statement."""
        known = self._state_rows
        blob = self._blob
        by_scope: dict[Scope, list[NewState]] = {}
        for s in last:
            by_scope.setdefault(s.scope, []).append(s)
        for scope, some in by_scope.items():
            unread = [s.resource_id for s in some if (agent, scope, s.resource_id) not in known]
            for name in unread:
                known[(agent, scope, name)] = None
            for resource_id, rowid, _ in self._by_digest(
                _STATES_GET_ONE_SCOPE, scope, agent, unread
            ):
                known[(agent, scope, resource_id)] = int(rowid)
            changed: list[tuple[Any, ...]] = []
            new: list[NewState] = []
            for s in some:
                rowid = known[(agent, scope, s.resource_id)]
                if rowid is None:
                    new.append(s)
                else:
                    changed.append((rowid, blob(s.data), s.position))
            if changed:
                self._run.each(_STATES_UPDATE, changed, (self._now,))
            if new:
                digests = sequencing.digests(
                    scope.tenant, scope.namespace, agent, [s.resource_id for s in new]
                )
                self._run.each(
                    _STATES_INSERT,
                    [(d, s.resource_id, blob(s.data), s.position)
                     for d, s in zip(digests, new, strict=True)],
                    (scope.tenant, scope.namespace, agent, self._now),
                )  # fmt: skip
                for s in new:  # their rowids are looked up if they are written again
                    del known[(agent, scope, s.resource_id)]

    @spoils
    def effects_get(
        self, consumer: str, keys: Iterable[Scoped]
    ) -> dict[Scoped, list[StoredOutput] | None]:
        wanted = sorted(set(keys))
        found: dict[Scoped, list[StoredOutput] | None] = dict.fromkeys(wanted)
        if self._d.embedded:
            for scope, keys_ in _names_by_scope(wanted).items():
                for key, outputs in self._by_digest(_EFFECTS_GET_ONE_SCOPE, scope, consumer, keys_):
                    found[(scope, key)] = unpack_outputs(outputs)
            self._absent.update((consumer, s, k) for (s, k), v in found.items() if v is None)
            return found
        rows = self._run.each(
            EFFECTS_GET, [(s.tenant, s.namespace, consumer, k) for s, k in wanted]
        )
        for tenant, namespace, key, outputs in rows:
            found[(Scope(tenant, namespace), key)] = unpack_outputs(outputs)
        return found

    @spoils
    def effects_put(self, consumer: str, effects: Sequence[NewEffect]) -> None:
        if not effects:
            return
        seen = self._distinct_keys(consumer, effects)
        blob = self._blob
        target = (
            "meshforge_effects (tenant, namespace, consumer, key, command_id, created_at, outputs)"
        )
        if self._d.embedded:
            self._effects_put_embedded(consumer, effects)
            return
        rows = [(e.scope.tenant, e.scope.namespace, consumer, e.key, e.command_id, self._now,
                 blob(pack_outputs(e.outputs))) for e in effects]  # fmt: skip
        if self._d.copy_in is not None:
            try:
                self._run.insert(target, rows)
            except StoreError as exc:
                if exc.kind != "duplicate":
                    raise
                raise self._duplicate(consumer, f"a key is already stored ({exc})") from exc
        else:
            # DO NOTHING, then compare: the duplicate is named, and a concurrent transaction
            # storing the same key is waited for, as with a plain INSERT.
            inserted = self._run.each(
                f"INSERT INTO {target} VALUES {{rows}}"
                " ON CONFLICT (tenant, namespace, consumer, key) DO NOTHING"
                " RETURNING tenant, namespace, key",
                rows,
            )
            if len(inserted) != len(rows):
                stored = {(Scope(t, ns), k) for t, ns, k in inserted}
                scope, key = next(k for k in seen if k not in stored)
                raise self._duplicate(consumer, f"key {key!r} in {scope} is already stored")

    def _effects_put_embedded(self, consumer: str, effects: Sequence[NewEffect]) -> None:
        """``effects_put`` for SQLite: the keys this transaction has not already found absent
        are looked up first (one writer at a time: what is absent now stays absent until
        this transaction stores it), so a stored key is refused before anything is
        written. A scope's tenant and namespace, the consumer and the time are bound once
        a statement."""
        blob = self._blob
        by_scope: dict[Scope, list[tuple[Any, ...]]] = {}
        for e in effects:
            by_scope.setdefault(e.scope, []).append(
                (e.key, e.command_id, blob(pack_outputs(e.outputs)))
            )
        absent = self._absent
        for scope, rows in by_scope.items():
            unread = [r[0] for r in rows if (consumer, scope, r[0]) not in absent]
            stored = {
                r[0] for r in self._by_digest(_EFFECT_SEQS_ONE_SCOPE, scope, consumer, unread)
            }
            if stored:
                key = next(k for k in unread if k in stored)
                raise self._duplicate(consumer, f"key {key!r} in {scope} is already stored")
        for scope, rows in by_scope.items():
            keys = [r[0] for r in rows]
            found = sequencing.digests(scope.tenant, scope.namespace, consumer, keys)
            self._run.each(
                _EFFECTS_PUT_ONE_SCOPE,
                [(key, d, command_id, outputs)
                 for (key, command_id, outputs), d in zip(rows, found, strict=True)],
                (scope.tenant, scope.namespace, consumer, self._now),
            )  # fmt: skip
            absent.difference_update((consumer, scope, k) for k in keys)

    @classmethod
    def _distinct_keys(cls, consumer: str, effects: Sequence[NewEffect]) -> set[Scoped]:
        """The effects' keys; a key given twice is refused before anything is written."""
        seen: set[Scoped] = set()
        for e in effects:
            if (e.scope, e.key) in seen:
                raise cls._duplicate(consumer, f"key {e.key!r} in {e.scope} is given twice")
            seen.add((e.scope, e.key))
        return seen

    @staticmethod
    def _duplicate(consumer: str, what: str) -> StoreError:
        return StoreError(
            f"effects of consumer {consumer!r}: {what}; storing it again would double the effect",
            kind="duplicate",
        )

    @spoils
    def effects_mark_published(self, consumer: str, keys: Iterable[Scoped]) -> int:
        wanted = sorted(set(keys))
        if not wanted:
            return 0
        if self._d.embedded:
            seqs = [
                int(seq)
                for scope, keys_ in _names_by_scope(wanted).items()
                for _, seq in self._by_digest(_EFFECT_SEQS_ONE_SCOPE, scope, consumer, keys_)
            ]
            # A sequence already covered keeps the time of its first mark.
            fresh = [int(r[0]) for r in self._run.each(_UNCOVERED, [(q,) for q in seqs])]
            spans = sequencing.runs(fresh)
            if spans:
                self._run.each(_RUNS_PUT, spans, (self._now,))
            return len(seqs)
        rows = self._run.each(
            EFFECTS_MARK_PUBLISHED,
            [(s.tenant, s.namespace, consumer, k) for s, k in wanted],
            (self._now,),
        )
        return sum(int(r[0]) for r in rows)
