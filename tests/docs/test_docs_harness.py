"""The docs harness itself: markers, fragments, masking, command parsing, and the settings table."""

from __future__ import annotations

from pathlib import Path

import pytest
from doc_examples import ROOT, Session, check_commands, check_fragment, evaluate, matches, parse

from meshforge.ops.settings_table import BEGIN, END, render


def test_the_settings_table_of_getting_started_is_made_from_the_settings() -> None:
    text = (ROOT / "docs" / "GETTING_STARTED.md").read_text()
    shown = text.split(BEGIN + "\n", 1)[1].split(END, 1)[0]
    assert shown == render(), "run: python -m meshforge.ops.settings_table --write docs/GETTING_STARTED.md"
    assert "| `max_deliver` | `MESHFORGE_MAX_DELIVER` | `5` |" in shown
    assert "`max_deliver unlimited`" in shown and "`ack_wait 1s`" in shown  # what provisioning prints, explained


def test_a_fragment_must_compile_and_import_names_that_exist() -> None:
    assert check_fragment("from meshforge.transport.connection import connect\nawait connect()\n") is None
    assert "has none" in (check_fragment("from meshforge.transport.connection import konnect\n") or "")
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
