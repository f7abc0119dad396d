"""``DeadLetters.page``: dead letters paged by stream sequence, filtered, bounded; the console's list."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from meshforge.config import load_settings
from meshforge.deadletters.admin import DeadLetters
from meshforge.publish.publisher import Publisher
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_FAILED
from meshforge.transport.connection import Connection, connect
from meshforge.transport.server import EmbeddedServer


@pytest.fixture
async def letters(private_server: EmbeddedServer) -> AsyncIterator[tuple[DeadLetters, Connection]]:
    settings = load_settings({"nats_url": private_server.url}, env={})
    conn = await connect(settings, name="dlq-pages")
    await ensure(conn.js, default_streams(settings), [])
    yield DeadLetters(conn.js, Publisher(conn.js, settings)), conn
    await conn.close()


async def _store(conn: Connection, subject: str, reason: str) -> int:
    ack = await conn.js.publish(
        subject, b"{}", headers={"Dlq-Reason": reason}, stream=STREAM_FAILED
    )
    return int(ack.seq)


async def test_pages_walk_every_letter_once_by_sequence_skipping_kept_originals(
    letters: tuple[DeadLetters, Connection],
) -> None:
    admin, conn = letters
    stored = []
    for i in range(120):
        stored.append(
            await _store(
                conn,
                "failed.cmd.default.demo.p.create",
                "expired" if i % 10 == 0 else "max_deliveries",
            )
        )
        if i == 60:
            await _store(conn, "failed.original.MESHFORGE_COMMANDS.7", "")
    seen: list[int] = []
    start: int | None = 1
    pages = 0
    while start is not None:
        page, start = await admin.page(start=start, limit=50)
        seen += [letter.seq for letter in page]
        pages += 1
    assert seen == stored and pages == 3

    expired, _ = await admin.page(limit=5, reason="expired")
    assert [letter.seq for letter in expired] == stored[0:50:10]
    assert all(letter.reason == "expired" for letter in expired)
    narrowed, _ = await admin.page(subject_filter="failed.cmd.*.*.q.>")
    assert narrowed == []


async def test_a_rare_reason_reads_at_most_the_scan_limit_and_says_where_to_go_on(
    letters: tuple[DeadLetters, Connection],
) -> None:
    admin, conn = letters
    for _ in range(40):
        await _store(conn, "failed.cmd.default.demo.r.create", "max_deliveries")
    found, next_seq = await admin.page(reason="rejected", scan_limit=25)
    assert found == [] and next_seq == 26


async def test_since_finds_the_first_letter_stored_at_or_after_a_time(
    letters: tuple[DeadLetters, Connection],
) -> None:
    admin, conn = letters
    seqs = [await _store(conn, "failed.cmd.default.demo.s.create", "expired") for _ in range(64)]
    for k in (0, 1, 17, 40, 63):
        moment = (await admin.get(seqs[k])).stored_at
        assert moment is not None
        first = await admin.first_seq_since(moment)
        assert first <= seqs[k]
        assert (await admin.get(first)).stored_at >= moment  # type: ignore[operator]
        if first > seqs[0]:
            assert (await admin.get(first - 1)).stored_at < moment  # type: ignore[operator]
        page, _ = await admin.page(since=moment, limit=1)
        assert page[0].seq == first
