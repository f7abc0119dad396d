"""The faster header parser gives exactly what nats-py's own parser gives."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshforge.transport import headers
from meshforge.transport.headers import parse_header_lines

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
    assert parse_header_lines(raw)["Tenant-Id"] == "acme" and "Bad Name" not in parse_header_lines(raw)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(_PIECES, st.binary(max_size=6)), max_size=30))
def test_any_header_block_parses_as_nats_py_parses_it(pieces: list[bytes]) -> None:
    raw = b"".join(pieces)
    assert parse_header_lines(raw) == nats_parse(raw)
