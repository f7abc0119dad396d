"""The batch methods of ``SqlTransaction``: many states and effects in one statement each.

A batch of commands costs a handful of statements instead of several per command, which
is what a networked database (one round trip per statement) needs. Rows are named by
``(scope, id)`` pairs and matched with a row-value ``IN`` over a ``VALUES`` list, which
both dialects plan as primary-key lookups; lists past the parameter limit are chunked.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from meshforge.errors import StoreError
from meshforge.scope import Scope
from meshforge.store.base import NewEffect, NewState, Scoped, StoredOutput
from meshforge.store.sql import Dialect, Runner, dump_headers, load_headers, spoils

# Wrapped in a SELECT: SQLite scans the whole table for a bare ``IN (VALUES ...)``.
_LISTED = "(SELECT * FROM (VALUES {rows}) AS v)"


class BatchMethods:
    """``states_get``/``put``, ``effects_get``/``put``/``mark_published``; see ``base``."""

    _run: Runner
    _d: Dialect
    _now: Any

    @spoils
    def states_get(self, agent: str, resources: Iterable[Scoped]) -> dict[Scoped, bytes | None]:
        slots = sorted(set(resources))
        found: dict[Scoped, bytes | None] = dict.fromkeys(slots)
        if not slots:
            return found
        if self._d.resources_lock:
            # Serialises workers on each resource even before its first snapshot exists.
            names = [f"{s.tenant}\x1f{s.namespace}\x1f{agent}\x1f{r}" for s, r in slots]
            self._run.rows(self._d.resources_lock, (names,))
        rows = self._run.each(
            "SELECT tenant, namespace, resource_id, data FROM meshforge_states"
            " WHERE agent = ? AND (tenant, namespace, resource_id) IN "
            + _LISTED
            + self._d.for_update,
            [(s.tenant, s.namespace, r) for s, r in slots],
            (agent,),
        )
        for tenant, namespace, resource_id, data in rows:
            found[(Scope(tenant, namespace), resource_id)] = bytes(data)
        return found

    @spoils
    def states_put(self, agent: str, states: Sequence[NewState]) -> None:
        # One row per resource: an upsert may not touch the same row twice.
        last = {(s.scope, s.resource_id): s for s in states}
        self._run.each(
            "INSERT INTO meshforge_states (tenant, namespace, agent, resource_id, data, position,"
            " updated_at) VALUES {rows}"
            " ON CONFLICT (tenant, namespace, agent, resource_id) DO UPDATE"
            " SET data = excluded.data, position = excluded.position,"
            " updated_at = excluded.updated_at",
            [
                (s.scope.tenant, s.scope.namespace, agent, s.resource_id, bytes(s.data),
                 s.position, self._now)
                for s in last.values()
            ],
        )  # fmt: skip

    @spoils
    def effects_get(
        self, consumer: str, keys: Iterable[Scoped]
    ) -> dict[Scoped, list[StoredOutput] | None]:
        wanted = sorted(set(keys))
        found: dict[Scoped, list[StoredOutput] | None] = dict.fromkeys(wanted)
        rows = self._run.each(
            "SELECT e.tenant, e.namespace, e.key, o.position, o.subject, o.msg_id, o.data,"
            " o.headers FROM meshforge_effects e LEFT JOIN meshforge_effect_outputs o"
            " ON o.tenant = e.tenant AND o.namespace = e.namespace"
            " AND o.consumer = e.consumer AND o.key = e.key"
            " WHERE e.consumer = ? AND (e.tenant, e.namespace, e.key) IN "
            + _LISTED
            + " ORDER BY e.tenant, e.namespace, e.key, o.position",
            [(s.tenant, s.namespace, k) for s, k in wanted],
            (consumer,),
        )
        for tenant, namespace, key, position, subject, msg_id, data, headers in rows:
            outputs = found.get((scope := Scope(tenant, namespace), key))
            if outputs is None:
                outputs = found[(scope, key)] = []
            if position is not None:
                outputs.append(StoredOutput(int(position), subject, msg_id, bytes(data),
                                            load_headers(headers)))  # fmt: skip
        return found

    @spoils
    def effects_put(self, consumer: str, effects: Sequence[NewEffect]) -> None:
        if not effects:
            return
        wanted = [(e.scope, e.key) for e in effects]
        # DO NOTHING, then compare: a duplicate is named, and waits for (rather than
        # races) a concurrent transaction storing the same key.
        inserted = self._run.each(
            "INSERT INTO meshforge_effects (tenant, namespace, consumer, key, command_id,"
            " created_at) VALUES {rows}"
            " ON CONFLICT (tenant, namespace, consumer, key) DO NOTHING"
            " RETURNING tenant, namespace, key",
            [(s.tenant, s.namespace, consumer, k, e.command_id, self._now)
             for (s, k), e in zip(wanted, effects, strict=True)],
        )  # fmt: skip
        if len(inserted) != len(wanted):
            stored = {(Scope(t, ns), k) for t, ns, k in inserted}
            seen: set[Scoped] = set()
            for scope, key in wanted:
                if (scope, key) in seen or (scope, key) not in stored:
                    raise StoreError(
                        f"effect of consumer {consumer!r} key {key!r} in {scope} is already"
                        " stored; storing it again would double the effect",
                        kind="duplicate",
                    )
                seen.add((scope, key))
        self._run.each(
            "INSERT INTO meshforge_effect_outputs (tenant, namespace, consumer, key, position,"
            " subject, msg_id, data, headers) VALUES {rows}",
            [
                (e.scope.tenant, e.scope.namespace, consumer, e.key, o.position, o.subject,
                 o.msg_id, bytes(o.data), dump_headers(o.headers))
                for e in effects
                for o in e.outputs
            ],
        )  # fmt: skip

    @spoils
    def effects_mark_published(self, consumer: str, keys: Iterable[Scoped]) -> int:
        return self._run.each_count(
            "UPDATE meshforge_effects SET published_at = ?"
            " WHERE consumer = ? AND (tenant, namespace, key) IN " + _LISTED,
            [(s.tenant, s.namespace, k) for s, k in sorted(set(keys))],
            (self._now, consumer),
        )
