"""The exactly-once audit: what the landed events, the dead letters and the store show.

Findings (each a plain dict, ready for ``audit.json``):

* duplicate effects: one command's output (causation id and output position) landed
  under two different event ids, or an event claims a command whose stored outputs do
  not include it;
* doubled outputs: one event id stored in the stream more than once (a re-publish after
  the duplicate window): every stream message is counted, never merged as a set;
* missing effects: a command the runtime received with no effect stored, no event
  caused by it, and no dead letter;
* lost outputs: an effect marked published whose event never reached the stream;
* dead letters by reason and subject, redeliveries, and end-to-end latency (the time
  the stream stored an event minus the logical ``ts`` it inherited from its command).

Example::

    findings = compute(spark, events_df, failed=failed_df, store=StoreTables.load(spark, url))
    assert findings["ok"]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import IntegerType
from pyspark.sql.window import Window

from meshforge.deadletters.originals import ORIGINAL_PREFIX

__all__ = ["StoreTables", "compute"]

_MAX_LISTED = 50  # findings listed one by one in the report; counts are always complete
_MAX_POSITION = 64


def _position(cause: str | None, event_id: str | None) -> int:
    """The output position whose derived id is ``event_id`` (-1 when none matches)."""
    if not cause or not event_id:
        return -1
    from meshforge.envelope import derive_id

    for position in range(_MAX_POSITION):
        if derive_id(cause, position) == event_id:
            return position
    return -1


@dataclass(frozen=True)
class StoreTables:
    """The store's tables as DataFrames (``None`` when no store was given)."""

    effects: DataFrame
    outputs: DataFrame
    inbox: DataFrame

    @classmethod
    def load(cls, spark: SparkSession, url: str) -> StoreTables:
        def table(name: str) -> DataFrame:
            return (
                spark.read.format("meshforge_store")
                .option("url", url)
                .option("table", name)
                .load()
                .cache()
            )

        return cls(effects=table("effects"), outputs=table("outputs"), inbox=table("inbox"))


def _rows(df: DataFrame, limit: int = _MAX_LISTED) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in df.limit(limit).collect()]


def _counted(
    df: DataFrame, order: list[str], limit: int = _MAX_LISTED
) -> tuple[int, list[dict[str, Any]]]:
    """The exact row count and the first ``limit`` rows, in one Spark job."""
    total = F.count("*").over(Window.partitionBy(F.lit(1)))
    rows = df.withColumn("_total", total).orderBy(*order).limit(limit).collect()
    if not rows:
        return 0, []
    found = int(rows[0]["_total"])
    return found, [
        {k: v for k, v in r.asDict(recursive=True).items() if k != "_total"} for r in rows
    ]


def _duplicate_effects(
    events: DataFrame, store: StoreTables | None
) -> tuple[int, list[dict[str, Any]]]:
    position = F.udf(_position, IntegerType(), useArrow=False)
    caused = (
        events.where(F.col("causation_id").isNotNull() & F.col("id").isNotNull())
        .select("causation_id", "type", "id", "subject")
        .dropDuplicates(["id"])
        .withColumn("position", position("causation_id", "id"))
        .cache()
    )
    known = F.countDistinct(F.when(F.col("position") >= 0, F.col("position")))
    groups = (
        caused.groupBy("causation_id", "type")
        .agg(
            F.countDistinct("id").alias("ids"),
            known.alias("positions"),
            F.sort_array(F.collect_set("id")).alias("event_ids"),
        )
        .where(F.col("ids") > F.greatest(F.col("positions"), F.lit(1)))
        .select(
            "causation_id",
            "type",
            "event_ids",
            F.lit("one output landed under several ids").alias("reason"),
        )
    )
    found = groups
    if store is not None:
        stored = store.outputs.select(
            F.col("command_id").alias("causation_id"), F.col("msg_id").alias("id")
        )
        commands = stored.select("causation_id").distinct()
        strays = (
            caused.join(commands, "causation_id")
            .join(stored, ["causation_id", "id"], "left_anti")
            .groupBy("causation_id", "type")
            .agg(F.sort_array(F.collect_set("id")).alias("event_ids"))
            .select(
                "causation_id",
                "type",
                "event_ids",
                F.lit("event is not among the command's stored outputs").alias("reason"),
            )
        )
        found = groups.unionByName(strays).dropDuplicates(["causation_id", "type"])
    return _counted(found, ["causation_id", "type"])


def _doubled_outputs(events: DataFrame) -> tuple[int, list[dict[str, Any]]]:
    """Event ids stored as several stream messages: the server's duplicate window was past
    when the same output was published again, so a consumer of the stream sees it twice."""
    # A stream message is (stream, seq): a table that landed one message twice is not this.
    message = [c for c in ("stream", "seq") if c in events.columns]
    copies = F.countDistinct(*map(F.col, message)) if message else F.count("*")
    seqs = F.sort_array(F.collect_set("seq")) if "seq" in events.columns else F.lit(None)
    doubled = (
        events.where(F.col("id").isNotNull())
        .groupBy("id")
        .agg(
            copies.alias("copies"),
            seqs.alias("seqs"),
            F.first("causation_id", ignorenulls=True).alias("causation_id"),
            F.first("type", ignorenulls=True).alias("type"),
        )
        .where(F.col("copies") > 1)
        .select("id", "type", "causation_id", "copies", "seqs")
    )
    return _counted(doubled, ["id"])


def _dead_letter_ids(failed: DataFrame) -> DataFrame:
    """Every id a dead letter can be matched by: envelope id, message id, idempotency key."""
    h = F.col("headers")
    ids = F.array_compact(
        F.array(
            F.col("id"),
            h.getItem("Nats-Msg-Id"),
            F.col("idempotency_key"),
            h.getItem("Idempotency-Key"),
        )
    )
    return failed.select(F.explode(ids).alias("dead_id")).distinct()


# An effect is found by its scope, consumer and idempotency key.
_EFFECT_KEY = ("tenant", "namespace", "consumer", "key")


def _missing_effects(
    events: DataFrame,
    failed: DataFrame | None,
    store: StoreTables | None,
    commands: DataFrame | None,
) -> tuple[int | None, int, list[dict[str, Any]]]:
    """(commands known, missing count, first missing); commands is None when unknowable."""
    columns = ["command_id", "key", "type", "subject", "consumer", "status", "deliveries"]
    frames: list[DataFrame] = []
    if store is not None:
        inbox = store.inbox.where(F.coalesce(F.col("subject"), F.lit("cmd.")).startswith("cmd."))
        frames.append(
            inbox.join(store.effects.select(*_EFFECT_KEY), list(_EFFECT_KEY), "left_anti").select(
                F.coalesce("message_id", "key").alias("command_id"),
                "key",
                "type",
                "subject",
                "consumer",
                "status",
                "deliveries",
            )
        )
        known = inbox.select(F.coalesce("message_id", "key").alias("command_id"))
    if commands is not None:
        tokens = F.split(F.col("subject"), r"\.")
        cmd = commands.select(
            F.col("id").alias("command_id"), F.coalesce("idempotency_key", "id").alias("key"), "type", "subject",
            F.lit(None).cast("string").alias("consumer"), F.lit(None).cast("string").alias("status"),
            F.lit(None).cast("int").alias("deliveries"),
            # The subject's tenant and namespace: another tenant's effect never covers it.
            tokens.getItem(1).alias("tenant"), tokens.getItem(2).alias("namespace"),
        )  # fmt: skip
        listed = commands.select(F.col("id").alias("command_id"))
        if store is not None:
            scoped = ["tenant", "namespace"]
            cmd = cmd.join(
                store.effects.select(*scoped, "command_id"), [*scoped, "command_id"], "left_anti"
            )
            cmd = cmd.join(store.effects.select(*scoped, "key"), [*scoped, "key"], "left_anti")
            known = known.unionByName(listed)
        else:
            known = listed
        frames.append(cmd)
    if not frames:
        return None, 0, []
    candidates = frames[0]
    for frame in frames[1:]:
        candidates = candidates.unionByName(frame)
    caused = (
        events.select(F.col("causation_id").alias("command_id"))
        .where(F.col("command_id").isNotNull())
        .distinct()
    )
    missing = (
        candidates.select(*columns)
        .dropDuplicates(["command_id"])
        .join(caused, "command_id", "left_anti")
    )
    if failed is not None:
        dead = _dead_letter_ids(failed).cache()
        missing = missing.join(dead, missing["command_id"] == dead["dead_id"], "left_anti")
        missing = missing.join(dead, missing["key"] == dead["dead_id"], "left_anti")
    count, rows = _counted(missing, ["command_id"])
    return known.distinct().count(), count, rows


def _lost_outputs(events: DataFrame, store: StoreTables | None) -> tuple[int, list[dict[str, Any]]]:
    if store is None:
        return 0, []
    landed = (
        events.select(F.col("id").alias("msg_id")).where(F.col("msg_id").isNotNull()).distinct()
    )
    lost = (
        store.outputs.where(F.col("published_at").isNotNull() & F.col("subject").startswith("evt."))
        .select("command_id", "position", "subject", "msg_id")
        .join(landed, "msg_id", "left_anti")
    )
    return _counted(lost, ["command_id", "position"])


def _dead_letters(failed: DataFrame | None) -> dict[str, Any]:
    if failed is None:
        return {"total": 0, "by_reason": {}, "by_subject": {}, "deliveries": 0, "examples": []}
    h = F.col("headers")
    dl = failed.select(
        F.coalesce(h.getItem("Dlq-Reason"), F.lit("unknown")).alias("reason"),
        F.coalesce(h.getItem("Dlq-Original-Subject"), F.regexp_replace("subject", r"^failed\.", "")).alias("subject"),
        h.getItem("Dlq-Error").alias("error"), h.getItem("Dlq-Deliveries").cast("int").alias("deliveries"), "ts",
    )  # fmt: skip
    groups = (
        dl.groupBy("reason", "subject")
        .agg(F.count("*").alias("n"), F.sum("deliveries").alias("d"))
        .collect()
    )
    by_reason: dict[str, int] = {}
    by_subject: dict[str, int] = {}
    for g in groups:
        by_reason[g["reason"]] = by_reason.get(g["reason"], 0) + int(g["n"])
        by_subject[g["subject"]] = by_subject.get(g["subject"], 0) + int(g["n"])
    return {
        "total": sum(by_reason.values()),
        "by_reason": dict(sorted(by_reason.items(), key=lambda kv: -kv[1])),
        "by_subject": dict(sorted(by_subject.items(), key=lambda kv: -kv[1])[:100]),
        "deliveries": sum(int(g["d"] or 0) for g in groups),
        "examples": _rows(dl.orderBy("ts").select("reason", "subject", "error", "deliveries"), 20),
    }


def _inbox_figures(store: StoreTables) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Redeliveries and handler time from the inbox, in one Spark job."""
    handler_ms = F.when(
        F.col("processed_at").isNotNull(),
        (F.unix_micros("processed_at") - F.unix_micros("received_at")) / 1000.0,
    )
    r = store.inbox.agg(
        F.count("*").alias("messages"),
        F.sum(F.when(F.col("deliveries") > 1, 1).otherwise(0)).alias("redelivered"),
        F.sum(F.greatest(F.col("deliveries") - 1, F.lit(0))).alias("redeliveries"),
        F.max("deliveries").alias("max_deliveries"),
        F.percentile_approx(handler_ms, [0.5, 0.9, 0.99], 10_000).alias("p"),
        F.count(handler_ms).alias("n"),
    ).collect()[0]
    redeliveries = {
        "inbox_messages": int(r["messages"] or 0),
        "messages_redelivered": int(r["redelivered"] or 0),
        "redeliveries": int(r["redeliveries"] or 0),
        "max_deliveries": int(r["max_deliveries"] or 0),
    }
    processing = (
        {"count": int(r["n"]), "p50": r["p"][0], "p90": r["p"][1], "p99": r["p"][2]}
        if r["n"]
        else None
    )
    return redeliveries, processing


def _event_figures(events: DataFrame) -> tuple[dict[str, Any], dict[str, Any]]:
    """Counts, copies of one id and the latency distribution, in one Spark job.

    Latency: the time the stream stored an event minus its ``ts``, which an output
    inherits from the command that caused it: command created to event stored.
    """
    per_id = (
        events.where(F.col("id").isNotNull())
        .groupBy("id")
        .agg(
            F.count("*").alias("copies"),
            F.first(
                (F.unix_micros(F.col("ts")) - F.unix_micros(F.col("envelope_ts"))) / 1000.0,
                ignorenulls=True,
            ).alias("ms"),
        )
    )
    r = per_id.agg(
        F.sum("copies").alias("rows"),
        F.count("*").alias("ids"),
        F.sum(F.when(F.col("copies") > 1, 1).otherwise(0)).alias("twice"),
        F.sum(F.col("copies") - 1).alias("extra"),
        F.count("ms").alias("n"),
        F.percentile_approx("ms", [0.5, 0.9, 0.99], 10_000).alias("p"),
        F.min("ms").alias("min"), F.max("ms").alias("max"), F.avg("ms").alias("mean"),
        F.histogram_numeric(F.col("ms"), F.lit(24)).alias("hist"),
    ).collect()[0]  # fmt: skip
    counts = {"event_ids": int(r["ids"] or 0)}
    latency: dict[str, Any] = {"count": int(r["n"] or 0)}
    if latency["count"]:
        latency.update(
            p50=r["p"][0], p90=r["p"][1], p99=r["p"][2], min=r["min"], max=r["max"], mean=r["mean"]
        )
        latency["histogram"] = _bins(
            sorted((float(b["x"]), float(b["y"])) for b in r["hist"] or [])
        )
    copies = {
        "events_landed_twice": int(r["twice"] or 0),
        "extra_event_copies": int(r["extra"] or 0),
    }
    return {**counts, **copies}, latency


def _bins(centres: list[tuple[float, float]]) -> list[list[float]]:
    """``[low, high, count]`` bins around the approximate histogram's centres."""
    bins = []
    for i, (x, y) in enumerate(centres):
        low = (
            (centres[i - 1][0] + x) / 2
            if i
            else max(0.0, x - (centres[1][0] - x) / 2 if len(centres) > 1 else 0.0)
        )
        high = (x + centres[i + 1][0]) / 2 if i + 1 < len(centres) else x + (x - low)
        bins.append([low, high, round(y)])
    return bins


def _timeline(events: DataFrame, failed: DataFrame | None) -> list[dict[str, Any]]:
    minute = F.date_trunc("minute", F.col("ts")).alias("minute")
    ev = events.groupBy(minute).agg(F.count("*").alias("events"))
    if failed is not None:
        dl = failed.groupBy(minute).agg(F.count("*").alias("dead_letters"))
        ev = ev.join(dl, "minute", "full_outer")
    else:
        ev = ev.withColumn("dead_letters", F.lit(0))
    rows = ev.fillna(0).orderBy("minute").limit(2000).collect()
    return [
        {
            "minute": r["minute"].isoformat(),
            "events": int(r["events"]),
            "dead_letters": int(r["dead_letters"]),
        }
        for r in rows
    ]


def compute(
    spark: SparkSession,
    events: DataFrame,
    *,
    failed: DataFrame | None = None,
    store: StoreTables | None = None,
    commands: DataFrame | None = None,
    since: datetime | None = None,
) -> dict[str, Any]:
    """Every finding of the audit; ``ok`` is False when exactly-once was violated.

    The store deletes effects and inbox rows after their retention (``effect_retention``,
    ``inbox_retention``), so a command older than that can no longer be checked for a
    missing effect: pass ``since`` (e.g. now minus the retention) to check only commands
    stored from then on. ``findings["window"]`` states the window that was checked.
    """
    if since is not None:
        if commands is not None:
            commands = commands.where(F.col("ts") >= F.lit(since))
        if store is not None:
            store = replace(store, inbox=store.inbox.where(F.col("received_at") >= F.lit(since)))
    events = events.cache()
    if failed is not None and "subject" in failed.columns:
        # The kept originals of truncated dead letters are copies, not dead letters.
        failed = failed.where(~F.col("subject").startswith(ORIGINAL_PREFIX))
    dup_count, dups = _duplicate_effects(events, store)
    doubled_count, doubled = _doubled_outputs(events)
    known, missing_count, missing = _missing_effects(events, failed, store, commands)
    lost_count, lost = _lost_outputs(events, store)
    types = {
        r["type"] or "(malformed)": int(r["count"])
        for r in events.groupBy("type").count().collect()
    }
    event_counts, latency = _event_figures(events)
    dead = _dead_letters(failed)
    redeliveries = {k: v for k, v in event_counts.items() if k != "event_ids"}
    if store is not None:
        inbox, processing = _inbox_figures(store)
        redeliveries.update(inbox)
        if processing:
            latency["processing"] = processing
    redeliveries["dead_letter_deliveries"] = dead.pop("deliveries")
    findings: dict[str, Any] = {
        "ok": dup_count == 0 and doubled_count == 0 and missing_count == 0 and lost_count == 0,
        "counts": {
            "events": sum(types.values()),
            "event_ids": event_counts["event_ids"],
            "events_by_type": dict(sorted(types.items(), key=lambda kv: -kv[1])),
            "commands": known,
            "effects": store.effects.count() if store is not None else None,
            "duplicate_effects": dup_count,
            "doubled_outputs": doubled_count,
            "missing_effects": missing_count,
            "lost_outputs": lost_count,
        },
        "violations": {
            "duplicate_effects": dups,
            "doubled_outputs": doubled,
            "missing_effects": missing,
            "lost_outputs": lost,
        },
        "dead_letters": dead,
        "redeliveries": redeliveries,
        "latency_ms": latency,
        "timeline": _timeline(events, failed),
    }
    first = store.effects.agg(F.min("created_at")).first() if store is not None else None
    oldest = first[0] if first is not None else None
    findings["window"] = {
        "commands_since": since.isoformat() if since is not None else None,
        "oldest_effect": oldest.isoformat() if oldest is not None else None,
        "note": "missing effects are checked for commands stored since commands_since (all when null);"
        " the store keeps effects only for effect_retention",
    }
    if known is None:
        findings["notes"] = [
            "no store and no commands table: commands without an effect were not checked"
        ]
    return findings
