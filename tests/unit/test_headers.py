"""The one header parser gives exactly what nats-py's own parser gives, to every reader."""

from __future__ import annotations

import asyncio
import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from header_table import HOSTILE
from meshforge.spark.fetch import Chunk, _add
from meshforge.transport import headers
from meshforge.transport.connection import new_client
from meshforge.transport.headers import parse_header_block, parse_header_lines

_PIECES = st.sampled_from(
    [b"Nats-Msg-Id", b"traceparent", b":", b": ", b"\r\n", b" ", b"\t", b"\x1c", b"\x0b", b"\xc3\xa9",
     b"\xff", b"a b", b"value", b"", b"::", b"X\x1fY"]
)  # fmt: skip


def nats_parse(raw: bytes) -> dict[str, str]:
    original = headers._NATS_PARSER
    assert original is not None
    result: dict[str, str] = original.__func__(raw)
    return result


def test_typical_headers_parse_as_nats_py_parses_them() -> None:
    raw = (
        b"Nats-Msg-Id: 5d1c\r\nIdempotency-Key:k-1\r\nTenant-Id:\tacme\r\nBad Name: x\r\n"
        b"caf\xc3\xa9: y\r\nNo-Colon\r\nEmpty:\r\nUtf8: \xc3\xa9t\xc3\xa9\r\nBroken: \xff\r\n\r\n"
    )
    assert parse_header_lines(raw) == nats_parse(raw)
    assert parse_header_lines(raw)["Tenant-Id"] == "acme" and "Bad Name" not in parse_header_lines(
        raw
    )


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(_PIECES, st.binary(max_size=6)), max_size=30))
def test_any_header_block_parses_as_nats_py_parses_it(pieces: list[bytes]) -> None:
    raw = b"".join(pieces)
    assert parse_header_lines(raw) == nats_parse(raw)


# --- one parser for every reader: the runtime's client and the Spark data source ----------


def spark_reads(block: bytes) -> dict[str, str] | None:
    """What the Spark data source makes of a stored block (``STREAM.MSG.GET``'s ``hdrs``)."""
    chunk = Chunk()
    message = {
        "subject": "s",
        "seq": 1,
        "time": "2026-11-27T00:00:00Z",
        "hdrs": base64.b64encode(block).decode(),
    }
    _add(chunk, message)
    return chunk.headers[0]


def runtime_reads(block: bytes) -> dict[str, str] | None:
    """What MeshForge's client class hands a subscriber for the block."""
    result: dict[str, str] | None = asyncio.run(new_client()._process_headers(block))
    return result


def nats_py_reads(block: bytes) -> dict[str, str] | None:
    result: dict[str, str] | None = asyncio.run(Client()._process_headers(block))
    return result


@pytest.mark.parametrize(
    ("block", "expected"), [row[1:] for row in HOSTILE], ids=[row[0] for row in HOSTILE]
)
def test_every_reader_parses_a_hostile_block_the_same_way(
    block: bytes, expected: dict[str, str] | None
) -> None:
    assert parse_header_block(block) == expected
    assert spark_reads(block) == expected
    assert runtime_reads(block) == expected
    assert nats_py_reads(block) == expected  # nats-py's own rules, with its own line parser


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(
        [b"NATS/1.0\r\n", b"NATS/1.0 ", b"NATS/1.0 404", b"NATS/1.0 100 Idle\r\n", b"NATS/1.0x"]
    ),
    st.lists(st.one_of(_PIECES, st.binary(max_size=6)), max_size=20),
)
def test_any_block_parses_as_nats_py_parses_it_and_never_raises(
    head: bytes, pieces: list[bytes]
) -> None:
    block = head + b"".join(pieces)
    ours = parse_header_block(block)
    try:
        theirs = nats_py_reads(block)
    except (IndexError, UnicodeDecodeError):  # nats-py gives up on some broken status lines
        return
    assert ours == (theirs or None)  # nats-py gives {} for a status line that holds nothing
    assert spark_reads(block) == ours


def test_a_block_too_short_to_hold_its_first_line_is_no_header() -> None:
    assert parse_header_block(b"") is None and parse_header_block(b"NATS/1.0") is None
    assert parse_header_block(None) is None
