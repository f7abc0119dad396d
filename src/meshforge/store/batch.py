"""The batch methods of ``SqlTransaction``: many states and effects in one statement each.

A batch of commands costs a handful of statements instead of several per command, which
is what a networked database (one round trip per statement) needs. Rows are named by
``(scope, id)`` pairs and matched with a join over a table of them, which both dialects
plan as primary-key lookups; lists past the parameter limit are chunked. On SQLite, where
a statement costs no round trip but each bound value several hundred instructions, a
statement takes one scope: what its rows share (tenant, namespace, agent or consumer,
time) is bound once, and ids are matched with ``IN (VALUES ...)`` on the primary key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from meshforge.errors import StoreError
from meshforge.store.base import NewEffect, NewState, Scoped, StoredOutput
from meshforge.store.packing import pack_outputs, unpack_outputs
from meshforge.store.sql import Dialect, Runner, spoils
from meshforge.topology.scope import Scope

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
EFFECTS_MARK_PUBLISHED = (
    "UPDATE meshforge_effects SET published_at = ? FROM ({keys}) AS u"
    " WHERE tenant = u.column1 AND namespace = u.column2 AND consumer = u.column3"
    " AND key = u.column4"
)

# The same for SQLite, one scope a statement: what every row shares is bound once (each
# value bound costs the sqlite3 module several hundred instructions), and the key column's
# IN list is probed in the primary key.
_STATES_GET_ONE_SCOPE = (
    "SELECT resource_id, data FROM meshforge_states WHERE tenant = ? AND namespace = ?"
    " AND agent = ? AND resource_id IN (VALUES {rows})"
)
_EFFECTS_GET_ONE_SCOPE = (
    "SELECT key, outputs FROM meshforge_effects WHERE tenant = ? AND namespace = ?"
    " AND consumer = ? AND key IN (VALUES {rows})"
)
_MARK_ONE_SCOPE = (
    "UPDATE meshforge_effects SET published_at = ? WHERE tenant = ? AND namespace = ?"
    " AND consumer = ? AND key IN (VALUES {rows})"
)


def _by_scope(pairs: Iterable[Scoped]) -> dict[Scope, list[tuple[str]]]:
    """The names of ``pairs`` by their scope, each as a one-value row, in their order."""
    grouped: dict[Scope, list[tuple[str]]] = {}
    for scope, name in pairs:
        grouped.setdefault(scope, []).append((name,))
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
            for scope, names in _by_scope(slots).items():
                for resource_id, data in self._run.each(
                    _STATES_GET_ONE_SCOPE, names, (*scope, agent)
                ):
                    found[(scope, resource_id)] = bytes(data)
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
            # A scope's tenant and namespace, the agent and the time bound once a statement.
            # (WHERE true: SQLite reads an ON after FROM as a join's unless a WHERE comes first.)
            by_scope: dict[Scope, list[tuple[Any, ...]]] = {}
            for s in last:
                by_scope.setdefault(s.scope, []).append((s.resource_id, blob(s.data), s.position))
            for scope, some in by_scope.items():
                self._run.each(
                    f"INSERT INTO {columns} SELECT ?, ?, ?, column1, column2, column3, ?"
                    " FROM (VALUES {rows}) WHERE true" + upsert,
                    some, (scope.tenant, scope.namespace, agent, self._now),
                )  # fmt: skip
            return
        rows = [(s.scope.tenant, s.scope.namespace, agent, s.resource_id, blob(s.data),
                 s.position, self._now) for s in last]  # fmt: skip
        self._run.each(f"INSERT INTO {columns} VALUES {{rows}}" + upsert, rows)

    @spoils
    def effects_get(
        self, consumer: str, keys: Iterable[Scoped]
    ) -> dict[Scoped, list[StoredOutput] | None]:
        wanted = sorted(set(keys))
        found: dict[Scoped, list[StoredOutput] | None] = dict.fromkeys(wanted)
        if self._d.embedded:
            for scope, keys_ in _by_scope(wanted).items():
                for key, outputs in self._run.each(
                    _EFFECTS_GET_ONE_SCOPE, keys_, (*scope, consumer)
                ):
                    found[(scope, key)] = unpack_outputs(outputs)
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
            self._effects_put_embedded(consumer, effects, target)
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

    def _effects_put_embedded(
        self, consumer: str, effects: Sequence[NewEffect], target: str
    ) -> None:
        """``effects_put`` for SQLite: a scope's tenant and namespace, the consumer and the
        time bound once a statement. A key already stored fails one statement, which undoes
        only itself: the keys of its rows found stored now are the ones stored before."""
        blob = self._blob
        by_scope: dict[Scope, list[tuple[Any, ...]]] = {}
        for e in effects:
            by_scope.setdefault(e.scope, []).append(
                (e.key, e.command_id, blob(pack_outputs(e.outputs)))
            )
        sql = f"INSERT INTO {target} SELECT ?, ?, ?, column1, column2, ?, column3 FROM (VALUES {{rows}})"
        for scope, rows in by_scope.items():
            fixed = (scope.tenant, scope.namespace, consumer, self._now)
            for text, params, chunk in self._run.statements(sql, rows, fixed):
                try:
                    self._run.count(text, params, spoil=False)
                except StoreError as exc:
                    if exc.kind != "duplicate":
                        raise
                    found = self.effects_get(consumer, [(scope, r[0]) for r in chunk])
                    key = next(k for (_, k), outputs in found.items() if outputs is not None)
                    raise self._duplicate(
                        consumer, f"key {key!r} in {scope} is already stored"
                    ) from exc

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
        if self._d.embedded:
            return sum(
                self._run.each_count(_MARK_ONE_SCOPE, keys_, (self._now, *scope, consumer))
                for scope, keys_ in _by_scope(sorted(set(keys))).items()
            )
        return self._run.each_count(
            EFFECTS_MARK_PUBLISHED,
            [(s.tenant, s.namespace, consumer, k) for s, k in sorted(set(keys))],
            (self._now,),
        )
