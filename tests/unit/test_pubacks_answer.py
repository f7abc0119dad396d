"""A PubAck read on the quick path is the very ``PubAck`` nats-py builds from its JSON."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.js.api import PubAck

from meshforge.transport.pubacks import _answer

streams = st.sampled_from(
    ["S", "MESHFORGE_EVENTS", "a-b_c", 'q"uote', "back\\slash", "é"]
) | st.text(max_size=8)
extras = st.sampled_from(
    ["", ',"duplicate": true', ',"duplicate":true', ',"duplicate":false', ',"domain":"d"']
)


def reference(data: bytes) -> PubAck:
    resp = json.loads(data)
    return PubAck(
        stream=resp["stream"],
        seq=resp["seq"],
        domain=resp.get("domain"),
        duplicate=resp.get("duplicate"),
    )


@settings(max_examples=300, deadline=None)
@given(streams, st.integers(min_value=0, max_value=2**64 - 1), extras)
def test_same_pub_ack_as_from_its_json(stream: str, seq: int, extra: str) -> None:
    data = b'{"stream":%s,"seq":%d%s}' % (json.dumps(stream).encode(), seq, extra.encode())
    assert _answer(data, None) == reference(data)


def test_an_error_is_still_an_error() -> None:
    data = b'{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 2"},"stream":"S","seq":0}'
    assert not isinstance(_answer(data, None), PubAck)
