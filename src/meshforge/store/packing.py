"""Schema version 3: an effect's outputs live in its own row, packed into one column.

Storing an effect then writes one row under one key. With the outputs in a table of
their own, every output also went into that table's primary-key index at a random place
(the keys are random), which cost SQLite about one more page of WAL per command, and
every lookup joined the two. Readers go through the store's API, which unpacks them.

The packed form, output after output in position order: five unsigned 32-bit
little-endian integers (the position, then the byte lengths of subject, msg_id, data
and headers) followed by those bytes; subject and msg_id in UTF-8, headers as their
compact JSON text. No outputs pack to an empty value.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from meshforge.errors import StoreError, one_line
from meshforge.store.base import StoredOutput
from meshforge.store.sql import headers_json, load_headers

if TYPE_CHECKING:
    from meshforge.store.scoping import Step
    from meshforge.store.sql import Dialect, Runner

_HEAD = struct.Struct("<5I")
_PAGE = 1000


def pack_outputs(outputs: Sequence[StoredOutput]) -> bytes:
    """The outputs as one value for ``meshforge_effects.outputs``."""
    parts: list[bytes] = []
    if len(outputs) > 1:
        outputs = sorted(outputs, key=_position)
        for a, b in pairwise(outputs):
            if a.position == b.position:
                raise StoreError(f"two outputs at position {a.position}", kind="duplicate")
    try:
        for o in outputs:
            subject, msg_id = o.subject.encode(), o.msg_id.encode()
            data, headers = bytes(o.data), headers_json(o.headers)
            parts += (_HEAD.pack(o.position, len(subject), len(msg_id), len(data), len(headers)),
                      subject, msg_id, data, headers)  # fmt: skip
    except (UnicodeError, struct.error) as exc:
        raise StoreError(
            f"effect outputs cannot be stored: {one_line(exc)}", kind="invalid"
        ) from exc
    return b"".join(parts)


def _position(output: StoredOutput) -> int:
    return output.position


def unpack_outputs(packed: Any) -> list[StoredOutput]:
    """The outputs ``pack_outputs`` packed (none for an empty or NULL value)."""
    if not packed:
        return []
    view = memoryview(packed)
    outputs: list[StoredOutput] = []
    at, size, head = 0, len(view), _HEAD.size
    while at < size:
        position, n_subject, n_msg, n_data, n_headers = _HEAD.unpack_from(view, at)
        at += head
        subject = str(view[at : at + n_subject], "utf-8")
        at += n_subject
        msg_id = str(view[at : at + n_msg], "utf-8")
        at += n_msg
        data = bytes(view[at : at + n_data])
        at += n_data
        headers = load_headers(str(view[at : at + n_headers], "utf-8"))
        at += n_headers
        outputs.append(StoredOutput(position, subject, msg_id, data, headers))
    return outputs


def _pack_existing(run: Runner, dialect: Dialect) -> None:
    """Every stored output into its effect's row, effect by effect, in position order."""
    after: tuple[Any, ...] = ()
    current: tuple[Any, ...] | None = None
    outputs: list[StoredOutput] = []
    while True:
        where = (
            " WHERE (tenant, namespace, consumer, key, position) > (?, ?, ?, ?, ?)" if after else ""
        )
        rows = run.rows(
            "SELECT tenant, namespace, consumer, key, position, subject, msg_id, data, headers"
            f" FROM meshforge_effect_outputs{where}"
            f" ORDER BY tenant, namespace, consumer, key, position LIMIT {_PAGE}",
            after,
        )
        updates: list[tuple[Any, ...]] = []
        for r in rows:
            if current is not None and tuple(r[:4]) != current:
                updates.append((pack_outputs(outputs), *current))
                outputs = []
            current = tuple(r[:4])
            outputs.append(StoredOutput(int(r[4]), r[5], r[6], bytes(r[7]), load_headers(r[8])))
        if len(rows) < _PAGE and current is not None:
            updates.append((pack_outputs(outputs), *current))
        if updates:
            run.many(
                "UPDATE meshforge_effects SET outputs = ? WHERE tenant = ? AND namespace = ?"
                " AND consumer = ? AND key = ?",
                updates,
            )
        if len(rows) < _PAGE:
            break
        after = tuple(rows[-1][:5])
    run.rows("UPDATE meshforge_effects SET outputs = ? WHERE outputs IS NULL", (b"",))


STEPS: list[Step] = [
    "ALTER TABLE meshforge_effects ADD COLUMN outputs {blob}",
    _pack_existing,
    "DROP TABLE meshforge_effect_outputs",
]
