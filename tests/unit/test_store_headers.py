"""Headers as the store keeps them: compact JSON text, names sorted, str to str only."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshforge.errors import StoreError
from meshforge.store.sql import dump_headers, headers_json, load_headers

_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@given(st.dictionaries(_TEXT, _TEXT, max_size=8))
def test_headers_are_sorted_compact_json_and_read_back(headers: dict[str, str]) -> None:
    text = dump_headers(headers)
    assert json.loads(text) == headers and list(json.loads(text)) == sorted(headers)
    assert headers_json(headers) == text.encode() and load_headers(text) == headers


@pytest.mark.parametrize("bad", [{"A": 1}, {"A": None}, {2: "x"}, {"A": "ok", "B": b"x"}])
def test_a_header_that_is_not_str_to_str_is_refused_in_one_line(bad: dict[Any, Any]) -> None:
    with pytest.raises(StoreError, match="headers must map str to str") as info:
        headers_json(bad)
    assert "\n" not in str(info.value)
