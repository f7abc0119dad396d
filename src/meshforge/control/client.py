"""The operator's side of the control plane: send commands to nodes, wait for replies, read status.

Example::

    async with await connect(url="nats://127.0.0.1:4222") as conn:
        ctl = ControlClient(conn)
        command_id = await ctl.send("lab1", "node7", "echo", {"hello": "world"}, deadline="5m")
        reply = await ctl.wait_reply("lab1", "node7", command_id, timeout=10)
        print(reply.status if reply else "still queued")
        print(await ctl.status("lab1", "node7"))
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from meshforge.config import Settings, parse_duration
from meshforge.control.presence import Announcement, read_announcement
from meshforge.control.reply import REPLY_TYPE, Reply
from meshforge.envelope import H_CAUSATION, Envelope, Outbound, decode
from meshforge.errors import ConfigError, MalformedMessage, PublishError
from meshforge.publish.publisher import Publisher, PublishResult
from meshforge.topology.subjects import (
    STREAM_CONTROL,
    STREAM_REPLIES,
    control_command_subject,
    control_reply_subject,
    validate_token,
)
from meshforge.transport.connection import Connection
from meshforge.transport.headers import text_headers

__all__ = ["ControlClient", "NodeStatus", "TimeSpec", "node_durable", "to_timestamp"]

TimeSpec = datetime | str | float | int | None

# Replies are searched from a little before the send, so clock skew cannot hide one.
_LOOKBACK = timedelta(seconds=5)
# Reading the stored replies: the longest pause between two of them before giving up.
_SCAN_IDLE = 5.0


def _match(data: bytes, headers: dict[str, str], command_id: str) -> Reply | None:
    if headers.get(H_CAUSATION) not in (None, command_id):
        return None
    try:
        env = decode(data, headers)
        if env.type == REPLY_TYPE and env.causation_id == command_id:
            return Reply.from_envelope(env)
    except MalformedMessage:
        return None
    return None


H_TTL = "Nats-TTL"


def ttl_header(seconds: float) -> str:
    """A ``Nats-TTL`` value: whole seconds, at least one (the server's finest unit).

    >>> ttl_header(0.2), ttl_header(90.5)
    ('1s', '91s')
    """
    return f"{max(1, math.ceil(seconds))}s"


def node_durable(site: str, node: str) -> str:
    """The node's durable consumer name on MESHFORGE_CONTROL: ``node_<site>_<node>``."""
    return f"node_{validate_token(site, 'site')}_{validate_token(node, 'node')}"


def _format(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def to_timestamp(value: TimeSpec, *, what: str, now: datetime | None = None) -> str | None:
    """An RFC 3339 UTC timestamp from a datetime, an RFC 3339 string, or a delay from now
    (seconds as a number, or ``"30s"``, ``"+5m"``, ``"1h"``). Raises ConfigError naming ``what``.

    >>> to_timestamp("2030-01-01T00:00:00Z", what="deadline")
    '2030-01-01T00:00:00.000000Z'
    """
    if value is None:
        return None
    now = now or datetime.now(UTC)
    if isinstance(value, datetime):
        return _format(value if value.tzinfo else value.replace(tzinfo=UTC))
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a time or a delay, got {value!r}")
    if isinstance(value, int | float):
        return _format(now + timedelta(seconds=parse_duration(value, what)))
    text = value.strip()
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        pass
    else:
        return _format(parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC))
    try:
        seconds = parse_duration(text.removeprefix("+"), what)
    except ConfigError:
        raise ConfigError(
            f"{what}: expected an RFC 3339 time (2030-01-01T09:00:00Z) or a delay (30s, +5m), got {value!r}"
        ) from None
    return _format(now + timedelta(seconds=seconds))


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """What is known about a node: its last announcement (None if it never announced) and
    how many commands wait in its mailbox (pending plus delivered but not yet acked)."""

    site: str
    node: str
    announcement: Announcement | None
    mailbox_depth: int
    consumer_exists: bool

    @property
    def epoch(self) -> int | None:
        return self.announcement.epoch if self.announcement else None

    @property
    def last_seen(self) -> str | None:
        return self.announcement.last_seen if self.announcement else None

    @property
    def alive(self) -> bool:
        return self.announcement is not None and self.announcement.alive()

    def to_dict(self) -> dict[str, Any]:
        note = self.announcement
        return {
            "site": self.site,
            "node": self.node,
            "epoch": self.epoch,
            "version": note.version if note else None,
            "started_at": note.started_at if note else None,
            "last_seen": self.last_seen,
            "seconds_since_seen": round(note.age(), 3) if note else None,
            "state": note.state if note else None,
            "alive": self.alive,
            "mailbox_depth": self.mailbox_depth,
        }


class ControlClient:
    """Sends commands to node mailboxes and reads their replies and presence.

    ``send`` returns the command's id; ``wait_reply`` waits for the reply whose
    ``causation_id`` is that id; ``status`` reports epoch, last seen and mailbox depth.
    """

    def __init__(
        self,
        conn: Connection,
        *,
        settings: Settings | None = None,
        publisher: Publisher | None = None,
        source: str = "ctl",
    ) -> None:
        self.conn = conn
        self.settings = settings
        self.publisher = publisher or Publisher(conn.js, settings)
        self.source = source
        self._sent_at: dict[str, datetime] = {}

    def command(
        self,
        site: str,
        node: str,
        command: str,
        payload: Mapping[str, Any] | None = None,
        *,
        not_before: TimeSpec = None,
        deadline: TimeSpec = None,
        expect_epoch: int | None = None,
        command_id: str | None = None,
        job: str | None = None,
        ttl: float | None = None,
    ) -> Outbound:
        """The command ``send`` publishes, built but not sent (``send_many`` sends many)."""
        subject = control_command_subject(site, node)
        validate_token(command, "command")
        if expect_epoch is not None and (
            isinstance(expect_epoch, bool) or not isinstance(expect_epoch, int)
        ):
            raise ConfigError(f"expect_epoch: expected an integer, got {expect_epoch!r}")
        now = datetime.now(UTC)
        fields: dict[str, Any] = {
            "source": self.source,
            "resource_type": "node",
            "resource_id": f"{site}.{node}",
            "not_before_ts": to_timestamp(not_before, what="not_before", now=now),
            "deadline_ts": to_timestamp(deadline, what="deadline", now=now),
            "expected_node_epoch": expect_epoch,
        }
        if command_id:
            fields["id"] = command_id
        if job is not None:
            fields["extra"] = {"job": validate_token(job, "job")}
        item = Outbound.of(subject, Envelope.new(command, payload or {}, **fields))
        if ttl is not None:
            item.headers[H_TTL] = ttl_header(ttl)
        return item

    async def send(
        self,
        site: str,
        node: str,
        command: str,
        payload: Mapping[str, Any] | None = None,
        *,
        not_before: TimeSpec = None,
        deadline: TimeSpec = None,
        expect_epoch: int | None = None,
        command_id: str | None = None,
        job: str | None = None,
        ttl: float | None = None,
    ) -> str:
        """Drop a command into the node's mailbox; returns its id (the server stores it even
        while the node is down). ``command_id`` makes a re-send the same command; ``job``
        names the job it belongs to (a canceled job's commands are answered ``canceled``);
        ``ttl`` (seconds) has the server remove the letter once it expires (``Nats-TTL``)."""
        now = datetime.now(UTC)
        item = self.command(
            site, node, command, payload, not_before=not_before, deadline=deadline,
            expect_epoch=expect_epoch, command_id=command_id, job=job, ttl=ttl,
        )  # fmt: skip
        self._sent_at[item.msg_id] = now
        result = await self.publisher.publish(
            item.subject, item.data, headers=item.headers, msg_id=item.msg_id
        )
        if result.duplicate:
            # The server already holds this id: its reply may be older than this send.
            del self._sent_at[item.msg_id]
        return item.msg_id

    async def send_many(self, items: Sequence[Outbound]) -> list[PublishResult | PublishError]:
        """Publish commands built by ``command``, pipelined (a window of PubAcks awaited at
        once): each one's result, or the error that ended it, in order."""
        return await self.publisher.publish_each(items)

    async def wait_reply(
        self,
        site: str,
        node: str,
        command_id: str,
        timeout: float,  # noqa: ASYNC109
    ) -> Reply | None:
        """The node's reply to ``command_id``, or None if none arrived within ``timeout`` s.

        Reads MESHFORGE_REPLIES with an ephemeral (ordered) consumer filtered to the node's
        reply subject, from just before the send when this client sent it, else from the start.
        """
        return await self._scan(site, node, command_id, timeout, stored_only=False)

    async def find_reply(self, site: str, node: str, command_id: str) -> Reply | None:
        """The reply to ``command_id`` if the node already sent it (no waiting)."""
        subject = control_reply_subject(site, node)
        if not await self._stored(STREAM_REPLIES, subject):
            return None
        return await self._scan(site, node, command_id, _SCAN_IDLE, stored_only=True)

    async def _scan(
        self, site: str, node: str, command_id: str, seconds: float, *, stored_only: bool
    ) -> Reply | None:
        subject = control_reply_subject(site, node)
        sent = None if stored_only else self._sent_at.get(command_id)
        config = (
            ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=sent - _LOOKBACK
            )
            if sent is not None
            else ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        )
        sub = await self.conn.js.subscribe(
            subject, stream=STREAM_REPLIES, ordered_consumer=True, config=config
        )
        end = time.monotonic() + seconds
        try:
            while (left := end - time.monotonic()) > 0:
                try:
                    msg = await sub.next_msg(timeout=left)
                except (TimeoutError, NatsTimeoutError):
                    return None
                found = _match(msg.data, text_headers(msg.headers), command_id)
                if found is not None:
                    return found
                if stored_only and msg.metadata.num_pending == 0:
                    return None  # read every stored reply: it is not there
            return None
        finally:
            await sub.unsubscribe()

    async def request(
        self,
        site: str,
        node: str,
        command: str,
        payload: Mapping[str, Any] | None = None,
        *,
        timeout: float,  # noqa: ASYNC109
        **options: Any,
    ) -> tuple[str, Reply | None]:
        """``send`` then ``wait_reply``: the command id and its reply (None when still queued)."""
        command_id = await self.send(site, node, command, payload, **options)
        return command_id, await self.wait_reply(site, node, command_id, timeout)

    async def status(self, site: str, node: str) -> NodeStatus:
        """The node's last announcement and its mailbox depth.

        Depth is the durable consumer's pending plus unacknowledged messages; before the
        node ever started (no consumer yet) it counts the messages stored for its subject.
        """
        durable = node_durable(site, node)
        announcement = await read_announcement(self.conn.js, site, node)
        try:
            info = await self.conn.js.consumer_info(STREAM_CONTROL, durable)
        except NotFoundError:
            depth = await self._stored(STREAM_CONTROL, control_command_subject(site, node))
            return NodeStatus(site, node, announcement, depth, consumer_exists=False)
        depth = (info.num_pending or 0) + (info.num_ack_pending or 0)
        return NodeStatus(site, node, announcement, depth, consumer_exists=True)

    async def _stored(self, stream: str, subject: str) -> int:
        try:
            info = await self.conn.js.stream_info(stream, subjects_filter=subject)
        except NotFoundError:
            return 0
        return int((info.state.subjects or {}).get(subject, 0))
