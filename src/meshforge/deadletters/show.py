"""How a dead letter is shown to a person, the same in ``meshforge dlq show`` and the console.

A dead letter carries whatever a failing producer sent, so nothing of it reaches a terminal
or a page unescaped, and nothing of it is shown without a bound.
"""

from __future__ import annotations

import codecs
import json

__all__ = ["SHOW_BYTES", "SHOW_HEADERS", "SHOW_HEADER_VALUE", "pretty_json", "printable", "text_of"]

#: At most this many bytes of a body, headers, and characters of a value are shown.
SHOW_BYTES = 4096
SHOW_HEADERS = 100
SHOW_HEADER_VALUE = 300


def printable(text: str) -> str:
    """``text`` with control characters escaped, so no byte of a message drives the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def text_of(data: bytes, *, final: bool) -> str | None:
    """``data`` as UTF-8 text (a character cut at the end is dropped), or None for binary."""
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=final)
    except UnicodeDecodeError:
        return None


def pretty_json(text: str, max_bytes: int) -> str | None:
    """``text`` indented when it is JSON and the result stays near ``max_bytes``; else None."""
    try:
        pretty = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than Python recurses
        return None
    return pretty if len(pretty) <= max(4 * max_bytes, 1024) else None
