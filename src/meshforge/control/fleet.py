"""Every node the presence bucket knows (alive, late or gone, with epoch and mailbox depth)
and how many mailboxes the control stream holds: what ``ctl nodes`` and the console show.

A read costs the same few requests with 10 nodes or 10,000: the presence bucket is read in
one listing (``meshforge.transport.listing``: never silently short), the mailbox depths
come from the control stream's per-subject message counts (one stream info with a subject
filter, paged by the server), and the mailboxes are the stream's consumers (one per node
that ever started). A node that has a mailbox but never announced, or a stream at its
consumer limit (nodes past it never started), shows in ``announced`` against ``mailboxes``.

Example::

    fleet = await survey(conn.js, site="plant3")
    print(fleet.summary())                       # 1200 announced, 1200 mailboxes
    for row in fleet.rows:
        print(row.site, row.node, row.liveness, row.epoch, row.mailbox_depth)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from meshforge.control.presence import NODES_BUCKET, STALE_INTERVALS, Announcement
from meshforge.topology.specs import consumer_limit, js_api
from meshforge.topology.subjects import STREAM_CONTROL, control_command_subject, validate_token
from meshforge.transport.listing import read_bucket

__all__ = [
    "GONE_INTERVALS",
    "Fleet",
    "Liveness",
    "Mailboxes",
    "NodeRow",
    "announcements",
    "list_nodes",
    "liveness",
    "mailboxes",
    "survey",
]

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
    """One node as ``ctl nodes`` and the console's nodes page show it."""

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

    @property
    def last_seen(self) -> str:
        return self.announcement.last_seen

    @property
    def alive(self) -> bool:
        return self.liveness == "alive"

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


@dataclass(frozen=True, slots=True)
class Mailboxes:
    """The control stream's side: commands stored per mailbox subject, the number of
    mailboxes (consumers) and the stream's consumer limit as the server applies it (-1:
    none; a stream that sets none has nats-server 2.15's default, 1000)."""

    depths: dict[str, int]
    count: int
    limit: int

    @property
    def full(self) -> bool:
        """At its consumer limit: a node starting now is refused its mailbox."""
        return self.limit > 0 and self.count >= self.limit

    def depth(self, site: str, node: str) -> int:
        return self.depths.get(control_command_subject(site, node), 0)


@dataclass(frozen=True, slots=True)
class Fleet:
    """The announced nodes (of one site, or all) and the control stream's mailboxes."""

    rows: list[NodeRow]
    mailboxes: Mailboxes
    site: str | None = None

    @property
    def announced(self) -> int:
        return len(self.rows)

    def summary(self) -> str:
        """``N announced, M mailboxes`` (with a site: M still counts every site's)."""
        where = f" at site {self.site}" if self.site else ""
        every = " (all sites)" if self.site else ""
        limit = self.mailboxes.limit
        cap = f" of at most {limit} (control_max_consumers)" if limit > 0 else ""
        return f"{self.announced} announced{where}, {self.mailboxes.count} mailboxes{every}{cap}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "announced": self.announced,
            "mailboxes": self.mailboxes.count,
            "mailbox_limit": self.mailboxes.limit,
            "site": self.site,
            "nodes": [row.to_dict() for row in self.rows],
        }


async def announcements(js: JetStreamContext, site: str | None = None) -> list[Announcement]:
    """Every announcement in the presence bucket (of ``site`` only, when given), sorted by
    site and node; raises ``IncompleteListing`` rather than return part of them."""
    keys = f"{validate_token(site, 'site')}.*" if site else ">"
    try:
        entries = await read_bucket(js, NODES_BUCKET, keys)
    except NotFoundError:  # no bucket: no node ever announced
        return []
    notes = [Announcement.decode(entries[key].data) for key in sorted(entries)]
    return [note for note in notes if note is not None]


async def mailboxes(js: JetStreamContext, site: str | None = None) -> Mailboxes:
    """The stored commands per mailbox (of ``site``'s, when given), the mailboxes and their
    limit, from the control stream's info: one request per 100,000 mailboxes with commands.

    In a work-queue stream a command stays stored until its node acknowledges it, so the
    count per subject is the node's pending plus unacknowledged commands, and it is there
    before the node ever started.
    """
    pattern = f"control.cmd.{validate_token(site, 'site')}.*" if site else "control.cmd.>"
    depths: dict[str, int] = {}
    count, limit = 0, -1
    while True:
        try:
            info = await js_api(
                js,
                f"STREAM.INFO.{STREAM_CONTROL}",
                {"subjects_filter": pattern, "offset": len(depths)},
            )
        except NotFoundError:  # not provisioned yet: no mailbox
            return Mailboxes({}, 0, -1)
        state = info.get("state") or {}
        page: dict[str, int] = state.get("subjects") or {}
        depths.update(page)
        count = int(state.get("consumer_count") or 0)
        limit = consumer_limit((info.get("config") or {}).get("max_consumers"))
        if not page or len(depths) >= int(info.get("total") or 0):
            return Mailboxes(depths, count, limit)


async def survey(js: JetStreamContext, site: str | None = None) -> Fleet:
    """Every node the presence data knows (of ``site`` only, when given), by site and name,
    with its mailbox depth, and the mailboxes of the control stream."""
    notes = await announcements(js, site)
    boxes = await mailboxes(js, site)
    rows = [NodeRow(n, liveness(n), boxes.depth(n.site, n.node)) for n in notes]
    return Fleet(rows, boxes, site)


async def list_nodes(js: JetStreamContext, site: str | None = None) -> list[NodeRow]:
    """The rows of ``survey``: every node the presence data knows, by site and name."""
    return (await survey(js, site)).rows
