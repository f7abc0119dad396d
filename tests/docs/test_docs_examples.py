"""Every example in README.md and docs/ runs as printed (see doc_examples.py for how)."""

from __future__ import annotations

from pathlib import Path

import pytest
from doc_examples import DOCUMENTS, ROOT, Session, evaluate, parse


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_examples_of_a_document_run_as_printed(path: Path, tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    session = Session(tmp_path / "work")
    try:
        failures = evaluate(parse(path), session)
    finally:
        session.close()
    assert not failures, "\n\n".join(failures)
