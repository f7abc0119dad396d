"""The runtime's store as Spark tables (``format("meshforge_store")``), read through the
store's own API, not JDBC, so SQLite and PostgreSQL look the same.

Tables (option ``table``): ``effects`` (one row per processed idempotency key),
``outputs`` (one row per stored output of an effect), ``events`` (every event log, one
partition per tenant, namespace and agent) and ``inbox`` (received messages per
consumer). Every table has ``tenant`` and ``namespace`` columns: they are part of each
row's key (one idempotency key or resource id may appear once per tenant).

Example::

    effects = (spark.read.format("meshforge_store")
               .option("url", "sqlite:///.meshforge/store.db").option("table", "effects").load())
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from meshforge.errors import ConfigError
from meshforge.spark.nats_sync import lower_keys

if TYPE_CHECKING:
    from meshforge.store import Store

__all__ = ["TABLES", "StoreDataSource", "check_options"]

_TS = "timestamp"
_HEADERS = "map<string,string>"
_SCOPE = ", tenant string, namespace string"
TABLES: dict[str, str] = {
    "effects": f"consumer string, key string, command_id string, outputs int, created_at {_TS}, published_at {_TS}"
    + _SCOPE,
    "outputs": (
        "consumer string, key string, command_id string, position int, subject string, msg_id string, "
        f"data binary, headers {_HEADERS}, created_at {_TS}, published_at {_TS}" + _SCOPE
    ),
    "events": (
        "agent string, position long, event_id string, type string, resource_id string, "
        f"command_id string, key string, data binary, ts string, stored_at {_TS}" + _SCOPE
    ),
    "inbox": (
        "key string, consumer string, message_id string, type string, subject string, stream string, "
        "stream_seq long, status string, attempts int, deliveries int, error string, "
        f"resource_type string, resource_id string, headers {_HEADERS}, received_at {_TS}, "
        f"processed_at {_TS}, failed_at {_TS}, created_at {_TS}, updated_at {_TS}" + _SCOPE
    ),
}


def check_options(options: dict[str, str]) -> tuple[str, str]:
    """The store URL and table name, validated; ConfigError naming the problem."""
    url = options.get("url") or ""
    if not url:
        raise ConfigError(
            "meshforge_store: option 'url' is required (sqlite:///... or postgresql://...)"
        )
    table = (options.get("table") or "").lower()
    if table not in TABLES:
        raise ConfigError(
            f"meshforge_store: option 'table' must be one of {sorted(TABLES)}, got {table!r}"
        )
    if url.startswith("sqlite:///") and ":memory:" not in url:
        path = Path(url[len("sqlite:///") :])
        if not path.is_file():
            raise ConfigError(f"meshforge_store: no store at {url} (file {path} does not exist)")
    return url, table


class StoreDataSource(DataSource):
    """Read-only view of the store's effects, outputs, events and inbox."""

    @classmethod
    def name(cls) -> str:
        return "meshforge_store"

    def schema(self) -> str:
        return TABLES.get(str(lower_keys(self.options).get("table", "")).lower(), TABLES["effects"])

    def reader(self, schema: StructType) -> DataSourceReader:
        return StoreReader(lower_keys(self.options))


class StoreReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.url, self.table = check_options(options)

    def partitions(self) -> Sequence[InputPartition]:
        if self.table != "events":
            return [InputPartition(None)]
        from meshforge.store import open_store

        store = open_store(self.url)
        try:
            logs = store.logs()
        finally:
            store.close()
        return [InputPartition((scope.tenant, scope.namespace, agent)) for scope, agent in logs]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        from meshforge.store import open_store

        store = open_store(self.url)
        try:
            yield from _ROWS[self.table](store, partition.value)
        finally:
            store.close()


def _effects(store: Store, _: object) -> Iterator[tuple[Any, ...]]:
    for e in store.effects_read():
        yield (
            e.consumer, e.key, e.command_id, len(e.outputs), e.created_at, e.published_at,
            e.scope.tenant, e.scope.namespace,
        )  # fmt: skip


def _outputs(store: Store, _: object) -> Iterator[tuple[Any, ...]]:
    for e in store.effects_read():
        for o in e.outputs:
            yield (
                e.consumer, e.key, e.command_id, o.position, o.subject, o.msg_id,
                o.data, dict(o.headers), e.created_at, e.published_at, e.scope.tenant,
                e.scope.namespace,
            )  # fmt: skip


def _events(store: Store, log: object) -> Iterator[tuple[Any, ...]]:
    from meshforge.topology.scope import Scope

    if not isinstance(log, tuple):
        return
    tenant, namespace, agent = log
    for ev in store.events_read(str(agent), scope=Scope(str(tenant), str(namespace))):
        yield (
            ev.agent, ev.position, ev.event_id, ev.type, ev.resource_id, ev.command_id,
            ev.key, ev.data, ev.ts, ev.stored_at, ev.scope.tenant, ev.scope.namespace,
        )  # fmt: skip


def _inbox(store: Store, _: object) -> Iterator[tuple[Any, ...]]:
    for r in store.inbox_read():
        yield (
            r.key, r.consumer, r.message_id, r.type, r.subject, r.stream, r.stream_seq, r.status,
            r.attempts, r.deliveries, r.error, r.resource_type, r.resource_id, dict(r.headers),
            r.received_at, r.processed_at, r.failed_at, r.created_at, r.updated_at,
            r.scope.tenant, r.scope.namespace,
        )  # fmt: skip


_ROWS = {"effects": _effects, "outputs": _outputs, "events": _events, "inbox": _inbox}
