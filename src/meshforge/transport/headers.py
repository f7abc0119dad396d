"""MeshForge's one NATS header parser: nats-py's rules, faster.

nats-py parses every received message's header block in ``Client._parse_header_lines``
and checks each header name for whitespace with a generator over its characters: about
80 Python-level calls per MeshForge message, the largest single cost of receiving one.
``parse_header_lines`` gives the same dict (same skipped lines, same decoding) with one
``str.split`` per name instead (and for a block of printable ASCII, the usual one, one decode
for the whole block). ``parse_header_block`` reads a whole block, its ``NATS/1.0`` line and
an inline status (``NATS/1.0 404 No Messages``: ``Status`` and ``Description``) included,
as nats-py's ``Client._process_headers`` does, but never raises.

Every reader uses them: MeshForge's client class (``meshforge.transport.connection``) for
what it receives, the Spark data source for the stored blocks ``STREAM.MSG.GET`` returns.
The rules, for every reader alike: a line without ``:`` or a name holding whitespace or
a byte that is not ASCII is skipped; a repeated name keeps its last value; names keep
their case; names and values are stripped of whitespace; a value is UTF-8 (a bad byte
becomes U+FFFD); a block of any size is read whole (the server bounds it); a block with
no header at all is ``None`` (where nats-py gives ``{}`` for a status line holding nothing).

Example::

    parse_header_lines(b"Nats-Msg-Id: m-1\\r\\nBad Name: x\\r\\n")   # {'Nats-Msg-Id': 'm-1'}
    parse_header_block(b"NATS/1.0 408 Request Timeout\\r\\n\\r\\n")
    # {'Status': '408', 'Description': 'Request Timeout'}
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from email.header import Header, decode_header
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client

if TYPE_CHECKING:
    from nats.aio.msg import Msg

__all__ = [
    "PRODUCER_PREFIX",
    "RESERVED",
    "RESERVED_PREFIX",
    "header_text",
    "is_reserved",
    "parse_header_block",
    "parse_header_lines",
    "producer_headers",
    "server_status",
    "text_headers",
]

#: The header namespace the runtime owns (docs/CONTRACT.md, "Reserved headers"): every
#: ``Dlq-*`` header. The router writes them; the tools (``dlq``, the console, the
#: pipeline's audit) read them and trust only the router's copy.
RESERVED_PREFIX = "Dlq-"
#: Each reserved header the runtime writes and some tool reads, by name.
RESERVED = (
    "Dlq-Reason",
    "Dlq-Error",
    "Dlq-Deliveries",
    "Dlq-Original-Subject",
    "Dlq-Stream",
    "Dlq-Stream-Seq",
    "Dlq-Consumer",
    "Dlq-Timestamp",
    "Dlq-Truncated",
    "Dlq-Original",
    "Dlq-Chunk",
    "Dlq-Original-Headers",
)
# The header names nats-py publishes (an HTTP token); the server itself accepts more.
_SENDABLE_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: A producer's own copy of a reserved header is kept under this prefix, which nothing reads.
PRODUCER_PREFIX = "Producer-"

_CRLF = b"\r\n"
_HDR_LINE = len(b"NATS/1.0")  # a block's first line; a space after it: an inline status
_STATUS = 3  # a status is three digits: 100, 404, 408, 503...
_SPACE = ord(" ")
# nats-py's own parser, kept for comparison (the tests check both agree).
_NATS_PARSER = Client.__dict__.get("_parse_header_lines")


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """``Name: Value`` lines to a dict, exactly as nats-py's own parser does."""
    try:
        lines = raw.decode("ascii").split("\r\n")
    except UnicodeDecodeError:
        return _parse_any(raw)
    if not "".join(lines).isprintable():
        return _parse_any(raw)
    # Printable ASCII only: a space is the one whitespace a name or value can hold.
    out: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep:
            continue
        if " " in name:
            name = name.strip()
            if " " in name:
                continue
        out[name] = value.strip()
    return out


def _parse_any(raw: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in raw.split(_CRLF):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue  # a non-ASCII name could never be looked up
        # str.split() breaks on exactly the characters str.isspace() names.
        if key and key.split() != [key]:
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


def parse_header_block(block: bytes | None) -> dict[str, str] | None:
    """A whole header block (``NATS/1.0[ status[ description]]\\r\\nName: Value\\r\\n...``)
    to a dict, as nats-py's ``_process_headers`` gives it; ``None`` when it holds nothing."""
    if not block or len(block) <= _HDR_LINE:
        return None
    out: dict[str, str] = {}
    rest = block[_HDR_LINE:]
    if rest[0] == _SPACE:  # an inline status, maybe a description, maybe headers after them
        line = block[_HDR_LINE + 1 :]
        status = line[:_STATUS].strip().decode("utf-8", "replace")
        if status.isdigit():
            out["Status"] = status
        desc = line[_STATUS + 1 : len(line) - 2 * len(_CRLF)]
        if desc:
            end = desc.find(_CRLF)
            if end > 0:
                out["Description"] = desc[:end].decode("utf-8", "replace")
                out.update(parse_header_lines(desc[end + len(_CRLF) :]))
            else:
                out["Description"] = desc.decode("utf-8", "replace")
        rest = rest[rest.find(_CRLF) + len(_CRLF) :]
    if len(rest) > len(_CRLF):
        # nats-py reads the lines from just after "NATS/1.0\r\n" (a status line's tail
        # has a space in its name, so it is skipped as any such line is)
        out.update(parse_header_lines(block[_HDR_LINE + len(_CRLF) :]))
    return out or None


def header_text(value: object) -> str:
    """Any header value nats-py hands back as printable-ready ``str``, never raising.

    Subscriptions give ``str``; ``js.get_msg`` gives an ``email.header.Header`` for a value
    that is not ASCII; bytes may come from elsewhere. Bytes are UTF-8 with a bad byte as
    U+FFFD, the rule of ``parse_header_lines``, so every reader shows one value alike.

    >>> from email.header import Header
    >>> header_text(Header("café".encode(), "unknown-8bit"))
    'café'
    >>> header_text(bytes([98, 255]))
    'b�'
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, Header):
        try:
            parts = decode_header(value)
        except Exception:  # a malformed encoded word: its text as the email package sees it
            return str(value).encode("utf-8", "replace").decode("utf-8", "replace")
        return "".join(
            part.decode("utf-8", "replace") if isinstance(part, bytes) else str(part)
            for part, _charset in parts
        )
    return str(value)


def text_headers(headers: Mapping[Any, Any] | None) -> dict[str, str]:
    """A header mapping from nats-py (``None`` too) with every name and value as ``str``."""
    if not headers:
        return {}
    return {header_text(k): header_text(v) for k, v in headers.items()}


def is_reserved(name: str) -> bool:
    """Whether ``name`` is in the runtime's own header namespace (case-insensitive)."""
    return name.lower().startswith(RESERVED_PREFIX.lower())


def producer_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """A producer's headers with each reserved one renamed to ``Producer-<name>``: kept as
    data, never read as if the runtime wrote it. A name that is not an HTTP token (which
    nats-py refuses to publish, so neither the dead letter nor its re-drive could be sent)
    is dropped.

    >>> producer_headers({"Dlq-Original": ">", "X-Note": "kept"})
    {'Producer-Dlq-Original': '>', 'X-Note': 'kept'}
    """
    out: dict[str, str] = {}
    for name, value in headers.items():
        if not _SENDABLE_NAME.fullmatch(name):
            continue  # the server took it, but no client can send it again: dropped
        out[PRODUCER_PREFIX + name if is_reserved(name) else name] = value
    return out


def server_status(msg: Msg) -> str | None:
    """The ``Status`` of a message the server sent of its own accord (a pull request's end
    or heartbeat: no reply subject; a push consumer's flow control: a ``$JS.FC.`` reply);
    None for a stored message, whose reply is its ack subject, whatever headers its
    publisher gave it (a ``Status`` of its own is data).

    >>> from nats.aio.msg import Msg
    >>> server_status(Msg(None, "_INBOX.x", "", b"", {"Status": "404"}))
    '404'
    >>> server_status(Msg(None, "cmd.x", "$JS.ACK.S.d.1.1.1.1.0", b"", {"Status": "404"})) is None
    True
    """
    headers = msg.headers
    if not headers or msg.reply.startswith("$JS.ACK."):
        return None
    return headers.get("Status")
