"""``encode_headers`` writes the very header block nats-py writes for the same dict."""

from __future__ import annotations

import asyncio

import nats.errors
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from meshforge.transport.pubacks import encode_headers

names = st.sampled_from(["Nats-Msg-Id", "Tenant-Id", "traceparent", " X-Pad ", "", "Bad Name", "x:y", "é"]) | st.text(max_size=12)  # fmt: skip
values = st.sampled_from(["v", "", " v ", "a\r\nb", "\tx", "x\x0b", "é ü", "a\u00a0", "\u2003b"]) | st.text(max_size=40)  # fmt: skip


def nats_py_block(headers: dict[str, str]) -> bytes:
    """The header block nats-py's own publish path builds for ``headers``."""
    client = Client()
    sent: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        sent.append(cmd)

    client._send_command = capture  # type: ignore[method-assign]
    client._flush_queue = None
    asyncio.run(client._send_publish("s", "r", b"", 0, headers))
    head, _, rest = sent[0].partition(b"\r\n")
    return rest[: int(head.split()[3])]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(names, values, max_size=6))
def test_same_block_as_nats_py(headers: dict[str, str]) -> None:
    try:
        expected = nats_py_block(headers)
    except nats.errors.BadHeaderError as refused:
        try:
            encode_headers(headers)
        except nats.errors.BadHeaderError as ours:
            assert str(ours) == str(refused)
            return
        raise AssertionError("nats-py refuses these headers, encode_headers did not") from None
    assert encode_headers(headers) == expected
    assert encode_headers(headers) == expected  # names now known: the quick path too
