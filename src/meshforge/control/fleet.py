"""Every node the presence bucket knows: alive, late or gone, with epoch and mailbox depth.

Example::

    for row in await list_nodes(conn.js, site="plant3"):
        print(row.site, row.node, row.liveness, row.epoch, row.mailbox_depth)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoKeysError, NotFoundError

from meshforge.control.client import node_durable
from meshforge.control.presence import NODES_BUCKET, STALE_INTERVALS, Announcement
from meshforge.topology.subjects import STREAM_CONTROL, control_command_subject, validate_token

__all__ = ["GONE_INTERVALS", "Liveness", "NodeRow", "list_nodes", "liveness"]

Liveness = Literal["alive", "late", "gone"]
# Not heard from for this many announcement intervals: the node is taken for gone.
GONE_INTERVALS = 10


def liveness(note: Announcement) -> Liveness:
    """``alive`` within 3 intervals, ``late`` up to 10, ``gone`` after that or once stopped."""
    if note.state != "up":
        return "gone"
    age = note.age()
    if age <= STALE_INTERVALS * note.interval:
        return "alive"
    return "late" if age <= GONE_INTERVALS * note.interval else "gone"


@dataclass(frozen=True, slots=True)
class NodeRow:
    """One node as ``ctl nodes`` shows it."""

    announcement: Announcement
    liveness: Liveness
    mailbox_depth: int

    @property
    def site(self) -> str:
        return self.announcement.site

    @property
    def node(self) -> str:
        return self.announcement.node

    @property
    def epoch(self) -> int:
        return self.announcement.epoch

    def to_dict(self) -> dict[str, Any]:
        note = self.announcement
        return {
            "site": note.site,
            "node": note.node,
            "liveness": self.liveness,
            "epoch": note.epoch,
            "version": note.version,
            "last_seen": note.last_seen,
            "seconds_since_seen": round(note.age(), 3),
            "state": note.state,
            "mailbox_depth": self.mailbox_depth,
        }


async def mailbox_depth(js: JetStreamContext, site: str, node: str) -> int:
    """Pending plus unacked on the node's consumer; before it exists, the stored commands."""
    try:
        info = await js.consumer_info(STREAM_CONTROL, node_durable(site, node))
    except NotFoundError:
        subject = control_command_subject(site, node)
        try:
            stream = await js.stream_info(STREAM_CONTROL, subjects_filter=subject)
        except NotFoundError:
            return 0
        return int((stream.state.subjects or {}).get(subject, 0))
    return (info.num_pending or 0) + (info.num_ack_pending or 0)


async def announcements(js: JetStreamContext, site: str | None = None) -> list[Announcement]:
    """Every announcement in the presence bucket (of ``site`` only, when given), sorted."""
    prefix = f"{validate_token(site, 'site')}." if site else ""
    try:
        kv = await js.key_value(NODES_BUCKET)
        keys = await kv.keys()  # nats-py's own filter matches substrings, not subjects
    except (BucketNotFoundError, NoKeysError, NotFoundError):
        return []
    notes = []
    for key in sorted(k for k in keys if k.startswith(prefix)):
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:  # deleted between listing and reading
            continue
        note = Announcement.decode(entry.value or b"")
        if note is not None:
            notes.append(note)
    return notes


async def list_nodes(js: JetStreamContext, site: str | None = None) -> list[NodeRow]:
    """Every node the presence data knows (of ``site`` only, when given), by site and name."""
    rows = []
    for note in await announcements(js, site):
        depth = await mailbox_depth(js, note.site, note.node)
        rows.append(NodeRow(note, liveness(note), depth))
    return rows
