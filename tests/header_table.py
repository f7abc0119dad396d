"""Hostile header blocks and what every MeshForge reader makes of each (transport/headers.py).

One table for the unit tests (the parsers themselves) and the integration tests (the same
blocks through a real server, read by the runtime's client and by the Spark data source).
"""

from __future__ import annotations

BIG = "x" * 60_000  # under JetStream's 64 KiB header limit, so a server stores it

# (name, header block as sent, what a reader gets)
HOSTILE: list[tuple[str, bytes, dict[str, str] | None]] = [
    ("plain", b"NATS/1.0\r\nA: 1\r\nB: two\r\n\r\n", {"A": "1", "B": "two"}),
    ("a repeated name keeps its last value", b"NATS/1.0\r\nA: 1\r\nA: 2\r\n\r\n", {"A": "2"}),
    ("names keep their case", b"NATS/1.0\r\nK: lower\r\nk: upper\r\n\r\n", {"K": "lower", "k": "upper"}),
    ("whitespace around names and values goes",
     b"NATS/1.0\r\n  Pad  :   v  \r\nTab:\tv\t\r\nTight:v\r\n\r\n", {"Pad": "v", "Tab": "v", "Tight": "v"}),
    ("a name with a space in it is skipped", b"NATS/1.0\r\nBad Name: x\r\nOk: y\r\n\r\n", {"Ok": "y"}),
    ("a name with a control character is skipped", b"NATS/1.0\r\nX\x1fY: v\r\nOk: y\r\n\r\n", {"Ok": "y"}),
    ("a line without a colon is skipped", b"NATS/1.0\r\nNoColon\r\nK: v\r\n\r\n", {"K": "v"}),
    ("a value keeps its colons", b"NATS/1.0\r\nK: a:b: c\r\n\r\n", {"K": "a:b: c"}),
    ("an empty value is kept", b"NATS/1.0\r\nEmpty:\r\n\r\n", {"Empty": ""}),
    ("an empty name is a name", b"NATS/1.0\r\n: v\r\n\r\n", {"": "v"}),
    ("a name that is not ASCII is skipped", b"NATS/1.0\r\ncaf\xc3\xa9: y\r\nK: v\r\n\r\n", {"K": "v"}),
    ("a value is UTF-8", b"NATS/1.0\r\nK: \xc3\xa9t\xc3\xa9\r\n\r\n", {"K": "\u00e9t\u00e9"}),
    ("a bad byte in a value is U+FFFD", b"NATS/1.0\r\nK: a\xffb\r\n\r\n", {"K": "a\ufffdb"}),
    ("a lone CR or LF stays in its value", b"NATS/1.0\r\nK: a\rb\r\nL: c\nd\r\n\r\n", {"K": "a\rb", "L": "c\nd"}),
    ("no header at all", b"NATS/1.0\r\n\r\n", None),
    ("only names that are skipped", b"NATS/1.0\r\nA B: 1\r\nnothing\r\n\r\n", None),
    ("a big block is read whole", b"NATS/1.0\r\nBig: " + BIG.encode() + b"\r\n\r\n", {"Big": BIG}),
    ("a status", b"NATS/1.0 503\r\n\r\n", {"Status": "503"}),
    ("a status with a description", b"NATS/1.0 404 No Messages\r\n\r\n",
     {"Status": "404", "Description": "No Messages"}),
    ("a status, a description and headers",
     b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 7\r\nNats-Last-Stream: 9\r\n\r\n",
     {"Status": "100", "Description": "Idle Heartbeat", "Nats-Last-Consumer": "7", "Nats-Last-Stream": "9"}),
    ("a status that is no number", b"NATS/1.0 abc Oops\r\nK: v\r\n\r\n", {"Description": "Oops", "K": "v"}),
    ("a header named Status does not make a status", b"NATS/1.0\r\nStatus: 404\r\n\r\n", {"Status": "404"}),
]  # fmt: skip
