"""Read options of the ``jetstream`` source: offsets, partitioning and data loss.

Offsets are stream sequence numbers. A streaming offset is ``{"<STREAM>": next_seq}``:
the first sequence not yet read. ``startingOffsets`` / ``endingOffsets`` accept
``earliest``, ``latest``, that JSON, or a time (RFC 3339, or epoch milliseconds).

Example::

    opts = ReadOptions.from_options({"stream": "MESHFORGE_EVENTS", "partitions": "4"})
    ranges = split_range(1, 1001, opts)      # four contiguous (first, last) ranges
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from pyspark.sql.datasource import InputPartition

from meshforge.errors import ConfigError
from meshforge.spark.nats_sync import StreamInfo, SyncNats, lower_keys

__all__ = [
    "DataLossError",
    "ReadOptions",
    "SeqRange",
    "check_data_loss",
    "resolve_offset",
    "split_range",
]

log = logging.getLogger("meshforge.spark")

DEFAULT_MESSAGES_PER_PARTITION = 250_000


class DataLossError(ConfigError):
    """Messages the reader still had to read were purged from the stream."""


class SeqRange(InputPartition):
    """One Spark partition: stream sequences ``first..last`` inclusive."""

    def __init__(self, index: int, first: int, last: int, *, check_loss: bool) -> None:
        self.index = index
        self.first = first
        self.last = last
        self.check_loss = check_loss


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = options.get(name.lower())
    if raw is None:
        return default
    value = str(raw).strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise ConfigError(f"jetstream: option {name!r} must be true or false, got {raw!r}")


def _int(options: Mapping[str, str], name: str, minimum: int = 1) -> int | None:
    raw = options.get(name.lower())
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"jetstream: option {name!r} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"jetstream: option {name!r} must be at least {minimum}, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """The read options, validated once on the driver."""

    stream: str
    filter_subject: str | None
    envelope: bool
    partitions: int | None
    min_partitions: int
    messages_per_partition: int
    starting: str | None
    ending: str | None
    max_per_trigger: int | None
    fail_on_data_loss: bool
    batch: int

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> ReadOptions:
        options = lower_keys(options)
        stream = options.get("stream")
        if not stream:
            raise ConfigError("jetstream: option 'stream' is required (e.g. MESHFORGE_EVENTS)")
        filter_subject = options.get("filtersubject") or None
        if filter_subject:
            from meshforge.topology.subjects import validate_subject

            validate_subject(filter_subject, wildcards=True)
        return cls(
            stream=stream,
            filter_subject=filter_subject,
            envelope=_bool(options, "envelope", False),
            partitions=_int(options, "partitions"),
            min_partitions=_int(options, "minPartitions") or 1,
            messages_per_partition=_int(options, "messagesPerPartition")
            or DEFAULT_MESSAGES_PER_PARTITION,
            starting=options.get("startingoffsets"),
            ending=options.get("endingoffsets"),
            max_per_trigger=_int(options, "maxMessagesPerTrigger"),
            fail_on_data_loss=_bool(options, "failOnDataLoss", True),
            batch=_int(options, "fetchBatch") or 10_000,
        )


def _parse_time(text: str) -> str | None:
    """RFC 3339 (UTC) for an RFC 3339 string or epoch milliseconds, None if neither."""
    if text.isdigit():
        return datetime.fromtimestamp(int(text) / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def resolve_offset(
    spec: str | None, default: str, info: StreamInfo, client: SyncNats, what: str
) -> int:
    """The sequence an offset option stands for (``latest`` = the next sequence)."""
    text = (spec if spec is not None else default).strip()
    low = text.lower()
    if low == "earliest":
        return max(info.first_seq, 1)
    if low == "latest":
        return info.next_seq
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError:
            raise ConfigError(f"jetstream: option {what!r} is not valid JSON: {text!r}") from None
        if not isinstance(parsed, dict) or info.name not in parsed:
            raise ConfigError(
                f"jetstream: option {what!r} must name stream {info.name!r}, got {text!r}"
            )
        value = parsed[info.name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"jetstream: option {what!r}: sequence must be a positive integer, got {value!r}"
            )
        return value
    when = _parse_time(text)
    if when is None:
        raise ConfigError(
            f'jetstream: option {what!r} must be earliest, latest, {{"{info.name}": seq}} '
            f"or a time, got {text!r}"
        )
    return client.seq_at_time(info.name, when)


def split_range(start: int, end: int, opts: ReadOptions) -> list[SeqRange]:
    """Contiguous partitions covering ``start <= seq < end``; the same answer every time."""
    span = end - start
    if span <= 0:
        return []
    count = opts.partitions or max(
        opts.min_partitions, math.ceil(span / opts.messages_per_partition)
    )
    count = max(1, min(count, span))
    size, extra = divmod(span, count)
    ranges, first = [], start
    for index in range(count):
        width = size + (1 if index < extra else 0)
        ranges.append(SeqRange(index, first, first + width - 1, check_loss=opts.fail_on_data_loss))
        first += width
    return ranges


def check_data_loss(info: StreamInfo, start: int, fail: bool) -> int:
    """Where reading from ``start`` really begins; raise or warn if messages were purged.

    Only limits streams count: in work-queue and interest streams removing messages
    is their purpose.
    """
    if info.retention != "limits" or start >= info.first_seq or info.first_seq <= 1:
        return start
    lost_to = min(info.first_seq, info.next_seq) - 1
    if lost_to < start:
        return start
    message = (
        f"stream {info.name}: messages {start}..{lost_to} were removed before they were read "
        f"(the first available is {info.first_seq})"
    )
    if fail:
        raise DataLossError(message + "; set failOnDataLoss=false to skip ahead")
    log.warning("%s; skipping ahead (failOnDataLoss=false)", message)
    return info.first_seq
