"""Message sizes: header counting and the one function that makes a message fit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshforge.errors import PublishError
from meshforge.transport.sizes import HEADER_LIMIT, SizeLimits, check_fits, fit_message, header_size

SUBJECT = "failed.cmd.default.demo.order.create"


def test_header_size_counts_the_block_as_sent() -> None:
    # NATS/1.0\r\n + "A: bc\r\n" + "Xy: é\r\n" (é is 2 bytes) + \r\n
    assert header_size({"A": "bc", "Xy": "é"}) == 10 + 7 + 8 + 2
    assert header_size({}) == 0


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@given(st.dictionaries(_TEXT, _TEXT, max_size=8))
def test_header_size_is_each_line_as_written(headers: dict[str, str]) -> None:
    # The block, a name, ": ", the value's UTF-8 bytes and CRLF a header, as the client writes.
    lines = sum(len(name) + 2 + len(value.encode()) + 2 for name, value in headers.items())
    assert header_size(headers) == (10 + lines + 2 if headers else 0)


def test_a_message_that_fits_is_unchanged() -> None:
    fitted = fit_message(SUBJECT, b"body", {"A": "b"}, SizeLimits(max_payload=100), mark="Cut")
    assert (fitted.data, fitted.headers, fitted.cut) == (b"body", {"A": "b"}, "")


def test_without_a_mark_an_oversized_message_is_refused_in_one_line() -> None:
    limits = SizeLimits(max_payload=1000)
    with pytest.raises(PublishError) as info:
        fit_message(SUBJECT, b"x" * 990, {"Nats-Msg-Id": "abc"}, limits)
    text = str(info.value)
    assert info.value.kind == "payload_too_large" and "\n" not in text
    assert SUBJECT in text and "max_payload of 1000 bytes" in text and "body 990" in text
    with pytest.raises(PublishError, match="header limit of 65535 bytes"):
        check_fits(SUBJECT, b"", {"X-Big": "y" * HEADER_LIMIT}, SizeLimits())


def test_body_is_cut_to_the_room_left_and_the_mark_says_so() -> None:
    limits = SizeLimits(max_payload=2000)
    headers = {"Nats-Msg-Id": "m-1", "Dlq-Reason": "malformed"}
    fitted = fit_message(SUBJECT, b"z" * 5000, headers, limits, mark="Dlq-Truncated")
    assert header_size(fitted.headers) + len(fitted.data) == 2000
    kept = len(fitted.data)
    assert fitted.cut == f"body=5000;kept={kept};headers={header_size(headers)};dropped="
    assert fitted.headers["Dlq-Truncated"] == fitted.cut
    assert fitted.data == b"z" * kept


def test_long_headers_are_dropped_longest_first_and_kept_ones_never() -> None:
    headers = {
        "Dlq-Reason": "malformed",
        "X-Big": "b" * 60_000,
        "X-Mid": "m" * 6_000,
        "X-Small": "s",
        "Nats-Msg-Id": "n" * 10_000,
    }
    fitted = fit_message(
        SUBJECT,
        b"{}",
        headers,
        SizeLimits(),
        mark="Dlq-Truncated",
        keep={"dlq-reason", "Nats-Msg-Id"},
    )
    assert "X-Big" not in fitted.headers and fitted.headers["X-Mid"] == "m" * 6_000
    assert fitted.headers["Nats-Msg-Id"] == "n" * 10_000 and fitted.data == b"{}"
    assert fitted.cut.endswith(f"headers={header_size(headers)};dropped=X-Big")
    assert header_size(fitted.headers) <= HEADER_LIMIT
    many = {f"X-{i}": "v" * 100 for i in range(2000)}
    fitted = fit_message(SUBJECT, b"", many, SizeLimits(), mark="Dlq-Truncated")
    assert header_size(fitted.headers) <= HEADER_LIMIT
    assert len(fitted.headers["Dlq-Truncated"]) < 600 and "more" in fitted.cut


def test_what_cannot_fit_even_when_cut_is_refused() -> None:
    with pytest.raises(PublishError, match="cannot be made to fit"):
        fit_message(
            SUBJECT, b"x", {"Dlq-Error": "e" * 900}, SizeLimits(max_payload=500),
            mark="Dlq-Truncated", keep={"Dlq-Error"},
        )  # fmt: skip
