"""The docs harness itself: markers, fragments, masking, command parsing, and the settings table."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from doc_examples import (
    DOCUMENTS,
    ROOT,
    Session,
    check_commands,
    check_fragment,
    evaluate,
    matches,
    parse,
    steps,
)

from meshforge.ops.settings_table import BEGIN, END, render


def test_the_settings_table_of_getting_started_is_made_from_the_settings() -> None:
    text = (ROOT / "docs" / "GETTING_STARTED.md").read_text()
    shown = text.split(BEGIN + "\n", 1)[1].split(END, 1)[0]
    assert shown == render(), (
        "run: python -m meshforge.ops.settings_table --write docs/GETTING_STARTED.md"
    )
    assert "| `max_deliver` | `MESHFORGE_MAX_DELIVER` | `5` |" in shown
    assert (
        "`max_deliver unlimited`" in shown and "`ack_wait 1s`" in shown
    )  # what provisioning prints, explained


def test_a_fragment_must_compile_and_import_names_that_exist() -> None:
    assert (
        check_fragment("from meshforge.transport.connection import connect\nawait connect()\n")
        is None
    )
    assert "has none" in (
        check_fragment("from meshforge.transport.connection import konnect\n") or ""
    )
    assert "does not compile" in (check_fragment("def f(:\n") or "")
    assert check_fragment("from django.db import connection\n") is None  # not ours: not imported


def test_commands_are_parsed_by_the_real_command_line() -> None:
    assert check_commands("meshforge dlq ls --limit 3 && meshforge events tail --json") is None
    assert "No such option" in (check_commands("MESHFORGE_X=1 meshforge dlq ls --nope") or "")
    assert "No such command" in (check_commands(".venv/bin/meshforge frobnicate") or "")
    assert check_commands("pip install meshforge  # not a meshforge command") is None


def test_masks_and_ellipsis() -> None:
    shown = "stream=S seq=1 id=0b0f7c1e-... duplicate=false\nat 2026-11-25T22:04:39.879400Z"
    got = "stream=S seq=1 id=7ef7cf92-2dd1-42d6-8c05-8f602e0987e6 duplicate=false\nat 2027-01-01T00:00:00Z"
    assert matches(shown, got)
    assert not matches(shown, got.replace("seq=1", "seq=2"))


@pytest.mark.parametrize(
    ("marker", "expected"),
    [
        ("", "failed"),  # run: the bad command fails the document
        ("<!-- docs-test: skip shown for its shape only -->\n", None),
        ("<!-- docs-test: parse-only needs a server elsewhere -->\n", None),
    ],
)
def test_markers_exclude_a_block_visibly(tmp_path: Path, marker: str, expected: str | None) -> None:
    doc = tmp_path / "DOC.md"
    doc.write_text(f"# t\n\n{marker}```console\n$ meshforge dlq show 42\n```\n")
    (tmp_path / "work").mkdir()
    session = Session(tmp_path / "work")
    try:
        failures = evaluate(parse(doc), session, root=tmp_path)
    finally:
        session.close()
    assert (expected in failures[0]) if expected else failures == []


def test_a_marker_without_a_reason_is_refused(tmp_path: Path) -> None:
    doc = tmp_path / "DOC.md"
    doc.write_text("<!-- docs-test: skip -->\n```console\n$ meshforge dlq ls\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        parse(doc)


# Every form of a moment the CLI prints, with the format that writes it again at another time.
_MOMENTS = [
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z"), "%Y-%m-%dT%H:%M:%S.%fZ"),
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"), "%Y-%m-%dT%H:%M:%SZ"),
    (re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"), "%Y-%m-%d %H:%M:%S,123"),
    (re.compile(r"(?<![\d-])\d\d-\d\d \d\d:\d\d:\d\d"), "%m-%d %H:%M:%S"),
    (re.compile(r"(?<![\d:])\d\d:\d\d:\d\d\.\d{3}"), "%H:%M:%S.456"),
]
_AGES = re.compile(r"\b\d+\.\ds\b")


def _at(text: str, moment: datetime, age: str) -> str:
    """``text`` as if captured at ``moment``: every printed moment and age rewritten."""
    for pattern, form in _MOMENTS:
        text = pattern.sub(moment.strftime(form), text)
    return _AGES.sub(age, text)


def _captured() -> list[tuple[str, str]]:
    """Every (document, shown output) of the documents that holds a printed moment."""
    found = []
    for path in DOCUMENTS:
        for command, shown in steps(path.read_text()):
            if any(pattern.search(shown) for pattern, _ in _MOMENTS):
                found.append((f"{path.name}: $ {command}", shown))
    return found


@pytest.mark.parametrize(
    "moment",
    [
        datetime(2026, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),  # the last moment of a year
        datetime(2027, 1, 1, 0, 0, 0, tzinfo=UTC),  # and the first of the next
        datetime(2027, 3, 31, 9, 5, 1, tzinfo=UTC),  # a 31st
        datetime(2028, 2, 29, 12, 0, 0, 1, tzinfo=UTC),  # a leap day
    ],
    ids=str,
)
def test_the_documents_outputs_match_on_any_date(moment: datetime) -> None:
    captured = _captured()
    # The sessions that print `dlq ls` tables, logs and `ctl status` are among them.
    assert len(captured) >= 10, captured
    assert any("When (UTC)" in shown for _, shown in captured)
    for where, shown in captured:
        assert matches(shown, _at(shown, moment, "12.5s")), where


def test_a_masked_moment_still_leaves_the_rest_compared() -> None:
    shown = "┃ 3 ┃ error ┃ 1 ┃ cmd.default.demo.order.create ┃ 11-27 11:40:26 ┃"
    assert matches(shown, shown.replace("11-27 11:40:26", "01-01 00:00:00"))
    assert not matches(shown, shown.replace("order.create", "order.cancel"))
    assert not matches("seq 3 at 12-31 23:59:59", "seq 4 at 12-31 23:59:59")
