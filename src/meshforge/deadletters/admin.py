"""Inspecting, re-driving and purging dead letters (``MESHFORGE_FAILED``).

A dead letter's id is its sequence in the stream. Kept originals of truncated dead
letters (``failed.original.<stream>.<seq>``, see ``meshforge.deadletters.originals``) share the
stream but are not dead letters: they are not listed or counted, and they go when their
dead letter is re-driven.

A ``DeadLetters`` bound to a tenant reads, counts, re-drives and purges that tenant's
dead letters only (``failed.cmd.<tenant>.>``): the subject is the authority, never a
header. A letter's kept original is the one the router wrote for it, found from the
letter's own stream and sequence and checked on read.

Example::

    letters = DeadLetters(conn.js, Publisher(conn.js))
    for letter in await letters.list(limit=20):
        print(letter.seq, letter.original_subject, letter.reason, letter.truncated)
    print(len(await letters.redrive_all()), "re-driven")
"""

from __future__ import annotations

import builtins
import logging
from datetime import datetime
from typing import TYPE_CHECKING

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from meshforge.deadletters.originals import (
    ORIGINAL_PREFIX,
    Original,
    is_original_copy,
    read_original,
    remove_original,
)
from meshforge.deadletters.route import (
    H_DLQ_ORIGINAL,
    DeadLetter,
    _letter,
    _without_dlq,
    redrive_id,
)
from meshforge.envelope import H_MSG_ID
from meshforge.errors import MeshForgeError, MissingTopology, one_line
from meshforge.topology.subjects import (
    DEAD_LETTER_PREFIX,
    STREAM_FAILED,
    matches,
    validate_subject,
)

if TYPE_CHECKING:
    from nats.js.api import RawStreamMsg

    from meshforge.publish.publisher import Publisher, PublishResult

__all__ = ["DeadLetters"]

log = logging.getLogger("meshforge.deadletter")

_STREAM_MISSING = 10059


class DeadLetters:
    """Inspect, re-drive and purge the dead-letter stream (``MESHFORGE_FAILED``).

    Example::

        letters = DeadLetters(conn.js, Publisher(conn.js))
        print(await letters.count())
        await letters.redrive_all()
    """

    def __init__(
        self,
        js: JetStreamContext,
        publisher: Publisher,
        *,
        stream: str = STREAM_FAILED,
        tenant: str | None = None,
    ) -> None:
        self.js = js
        self.publisher = publisher
        self.stream = stream
        self.tenant = tenant

    @property
    def scope(self) -> str | None:
        """The dead letters this API may touch (``failed.cmd.<tenant>.>``), None for all."""
        return f"{DEAD_LETTER_PREFIX}cmd.{self.tenant}.>" if self.tenant else None

    def within(self, subject_filter: str | None) -> str | None:
        """``subject_filter`` validated (a pattern under ``failed.``), inside this tenant when
        bound (no filter: the whole tenant); else ``MeshForgeError`` naming the tenant."""
        if subject_filter:
            validate_subject(subject_filter, wildcards=True)
        if not self.tenant:
            return subject_filter or None
        if not subject_filter:
            return self.scope
        tokens = subject_filter.split(".")
        if len(tokens) < 4 or tokens[:3] != ["failed", "cmd", self.tenant]:
            raise MeshForgeError(
                f"bound to tenant {self.tenant!r}: a subject must start with "
                f"failed.cmd.{self.tenant}., got {subject_filter[:80]!r}"
            )
        return subject_filter

    def _mine(self, letter: DeadLetter) -> bool:
        """Whether a tenant-bound API may see ``letter`` (its subject and original both
        the tenant's; the router writes them equal)."""
        scope = self.scope
        if scope is None:
            return True
        return matches(scope, letter.subject) and matches(
            scope.removeprefix(DEAD_LETTER_PREFIX), letter.original_subject
        )

    def _missing(self) -> MissingTopology:
        return MissingTopology(
            f"stream {self.stream} does not exist: create the streams with `meshforge provision`"
        )

    async def _subject_counts(self, subject_filter: str) -> dict[str, int]:
        info = await self.js.stream_info(self.stream, subjects_filter=subject_filter)
        return dict(info.state.subjects or {})

    async def count(self, subject_filter: str | None = None) -> int:
        """How many dead letters are stored (matching ``subject_filter``, e.g. ``failed.cmd.>``)."""
        subject_filter = self.within(subject_filter)
        try:
            if subject_filter:
                counts = await self._subject_counts(subject_filter)
                return sum(n for s, n in counts.items() if not is_original_copy(s))
            info = await self.js.stream_info(self.stream)
            kept = await self._subject_counts(ORIGINAL_PREFIX + ">")
        except nats.js.errors.NotFoundError:
            raise self._missing() from None
        return int(info.state.messages) - sum(kept.values())

    async def _next(self, seq: int, subject_filter: str | None) -> RawStreamMsg | None:
        """The first stored message at or after ``seq`` (matching), or None."""
        try:
            raw = await self.js.get_msg(
                self.stream, seq=seq, subject=subject_filter or ">", next=True
            )
        except nats.js.errors.NotFoundError as exc:
            if exc.err_code == _STREAM_MISSING:
                raise self._missing() from None
            return None  # no message at or after seq
        return raw if raw.seq is not None else None

    async def list(self, limit: int = 100, subject_filter: str | None = None) -> list[DeadLetter]:
        """The oldest ``limit`` dead letters (matching ``subject_filter``), oldest first."""
        subject_filter = self.within(subject_filter)
        letters: list[DeadLetter] = []
        seq = 1
        while len(letters) < limit:
            raw = await self._next(seq, subject_filter)
            if raw is None or raw.seq is None:
                break
            seq = raw.seq + 1
            if is_original_copy(raw.subject or ""):
                continue
            letters.append(
                _letter(raw.seq, raw.subject or "", raw.data or b"", raw.headers or {}, raw.time)
            )
        return letters

    async def page(
        self,
        *,
        start: int = 1,
        limit: int = 50,
        subject_filter: str | None = None,
        reason: str | None = None,
        since: datetime | None = None,
        scan_limit: int = 2000,
    ) -> tuple[builtins.list[DeadLetter], int | None]:
        """Up to ``limit`` dead letters from sequence ``start`` on (matching the subject
        pattern, ``reason`` and stored at or after ``since``), and the sequence the next
        page starts at (None at the end of the stream). Reads at most ``scan_limit``
        messages, so a rare reason never makes one page read a million letters."""
        subject_filter = self.within(subject_filter)
        if since is not None:
            start = max(start, await self.first_seq_since(since))
        letters: builtins.list[DeadLetter] = []
        seq = max(1, start)
        for _ in range(scan_limit):
            if len(letters) >= limit:
                return letters, seq
            raw = await self._next(seq, subject_filter)
            if raw is None or raw.seq is None:
                return letters, None
            seq = raw.seq + 1
            if is_original_copy(raw.subject or ""):
                continue
            letter = _letter(
                raw.seq, raw.subject or "", raw.data or b"", raw.headers or {}, raw.time
            )
            if reason is None or letter.reason == reason:
                letters.append(letter)
        return letters, seq

    async def first_seq_since(self, moment: datetime) -> int:
        """The sequence of the first message stored at or after ``moment`` (past the last
        when none is): a binary search over the stream, about 20 reads for a million."""
        try:
            state = (await self.js.stream_info(self.stream)).state
        except nats.js.errors.NotFoundError:
            raise self._missing() from None
        low, high = int(state.first_seq or 1), int(state.last_seq) + 1
        while low < high:
            mid = (low + high) // 2
            raw = await self._next(mid, None)
            if raw is None or raw.seq is None:
                high = mid
            elif raw.time is not None and raw.time < moment:
                low = raw.seq + 1
            else:
                high = mid
        return low

    async def get(self, seq: int) -> DeadLetter:
        """The dead letter with id ``seq``; raises ``MeshForgeError`` when there is none
        (or, for a tenant-bound API, when it is another tenant's: it looks absent)."""
        absent = MeshForgeError(f"no dead letter with id {seq} in {self.stream}")
        try:
            raw = await self.js.get_msg(self.stream, seq=seq)
        except nats.js.errors.NotFoundError as exc:
            if exc.err_code == _STREAM_MISSING:
                raise self._missing() from None
            raise absent from None
        letter = _letter(
            raw.seq or seq, raw.subject or "", raw.data or b"", raw.headers or {}, raw.time
        )
        if not self._mine(letter):
            raise absent
        return letter

    async def original(self, letter: DeadLetter) -> Original:
        """The whole message ``letter`` was made of: for a truncated dead letter, the
        original kept beside it; else the dead letter without its ``Dlq-*`` headers.
        Raises ``MeshForgeError`` when a truncated letter's original is gone."""
        if not self._mine(letter):
            raise MeshForgeError(f"no dead letter with id {letter.seq} in {self.stream}")
        if not letter.truncated:
            return Original(letter.original_subject, letter.original_headers, letter.data)
        copy = self._own_copy(letter)
        try:
            found = await read_original(
                self.js, self.stream, copy, subject_of=letter.original_subject
            )
        except MeshForgeError as exc:
            raise MeshForgeError(
                f"dead letter {letter.seq} is truncated ({letter.truncated}) and {exc}: "
                f"only its truncated copy is left (`meshforge dlq show {letter.seq}`)"
            ) from None
        return Original(letter.original_subject or found.subject, found.headers, found.data)

    def _own_copy(self, letter: DeadLetter) -> str:
        """The subject of ``letter``'s own kept original, as the router wrote the link; a
        ``Dlq-Original`` naming anything else (a stored forgery) is refused."""
        copy = letter.original_copy
        if not copy:
            raise MeshForgeError(
                f"dead letter {letter.seq} is truncated but names no source stream and "
                "sequence: its original cannot be found"
            )
        named = letter.headers.get(H_DLQ_ORIGINAL)
        if named is not None and named != copy:
            raise MeshForgeError(
                f"dead letter {letter.seq} names a kept original that is not its own "
                f"({named[:80]!r}, expected {copy}): refused"
            )
        return copy

    async def redrive(self, seq: int) -> PublishResult:
        """Publish dead letter ``seq`` again to its original subject with its original body and
        headers, then delete it (only after the PubAck: a failed re-drive keeps it).

        A truncated dead letter re-drives its whole kept original (then removes it too),
        or refuses when that is gone. The copy's ``Nats-Msg-Id`` is ``redrive_id(original
        id, seq)``, so re-driving the same dead letter twice (e.g. after a crash before
        the delete) stores it once.
        """
        return await self._redrive(await self.get(seq))

    async def _redrive(self, letter: DeadLetter) -> PublishResult:
        seq = letter.seq
        if is_original_copy(letter.subject):
            raise MeshForgeError(
                f"{seq} is the kept original of a truncated dead letter, not a dead letter: "
                "re-drive that dead letter instead"
            )
        if not letter.original_subject:
            raise MeshForgeError(f"dead letter {seq} names no original subject: cannot re-drive it")
        original = await self.original(letter)
        headers = _without_dlq(original.headers)
        msg_id = redrive_id(headers.get(H_MSG_ID) or f"dlq-{self.stream}-{seq}", seq)
        headers[H_MSG_ID] = msg_id
        result = await self.publisher.publish(
            letter.original_subject, original.data, headers=headers, msg_id=msg_id
        )
        await self._delete(seq)
        if letter.truncated:
            await remove_original(self.js, self.stream, self._own_copy(letter))
        log.info(
            "re-drove dead letter %d to %s (%s #%d)",
            seq,
            letter.original_subject,
            result.stream,
            result.seq,
        )
        return result

    async def redrive_all(
        self, subject_filter: str | None = None
    ) -> builtins.list[tuple[int, PublishResult]]:
        """Re-drive the dead letters (matching ``subject_filter``) present when it starts,
        oldest first, each once; returns ``(dead letter id, result)`` pairs. Dead letters
        written meanwhile (a re-driven message failing again) wait for the next call.
        Stops at the first failure (raising it)."""
        subject_filter = self.within(subject_filter)
        try:
            last = int((await self.js.stream_info(self.stream)).state.last_seq)
        except nats.js.errors.NotFoundError:
            raise self._missing() from None
        done: builtins.list[tuple[int, PublishResult]] = []
        seq = 1
        while seq <= last:
            raw = await self._next(seq, subject_filter)
            if raw is None or raw.seq is None or raw.seq > last:
                break
            seq = raw.seq + 1
            if is_original_copy(raw.subject or ""):
                continue
            letter = _letter(
                raw.seq, raw.subject or "", raw.data or b"", raw.headers or {}, raw.time
            )
            done.append((raw.seq, await self._redrive(letter)))
        return done

    async def purge(self, subject_filter: str | None = None) -> int:
        """Delete every dead letter (matching ``subject_filter``); returns how many there were.

        Without a filter the kept originals go too; ``failed.original.>`` removes only them.
        A tenant-bound API purges inside its tenant only (no filter: the whole tenant).
        """
        subject_filter = self.within(subject_filter)
        before = await self.count(subject_filter)
        try:
            await self.js.purge_stream(self.stream, subject=subject_filter)
        except nats.js.errors.NotFoundError:
            raise self._missing() from None
        log.info("purged %d dead letter(s) from %s", before, self.stream)
        return before

    async def _delete(self, seq: int) -> None:
        try:
            await self.js.delete_msg(self.stream, seq)
        except nats.js.errors.NotFoundError:
            pass  # deleted meanwhile (a concurrent re-drive or purge): the goal is met
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise MeshForgeError(
                f"dead letter {seq} was re-driven but could not be deleted ({one_line(exc, 200)}); "
                "re-driving it again stores no second copy"
            ) from None
