"""Strict parsing of the console's query, path and form parameters.

Whatever a request carries, a parameter is either what the route takes or a ``BadInput``,
which the pages show as a 400 with one line naming the parameter: never a 500. Numbers
are ASCII digits only (``str.isdigit`` accepts ``²``, which ``int`` refuses), bounded in
length and value; text is bounded in length.

Example::

    number("42", "start")                  # 42
    number("²", "start")                   # BadInput: start: expected a whole number ...
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from meshforge.errors import MeshForgeError

__all__ = ["MAX_NUMBER", "BadInput", "choice", "number", "numbers", "since", "text"]

MAX_NUMBER = 2**63 - 1  # a stream sequence fits in a signed 64-bit integer
MAX_SINCE_MINUTES = 10 * 366 * 24 * 60  # ten years ago: further back is "everything"
MAX_SELECTED = 1_000
_SHOWN = 40


class BadInput(MeshForgeError):
    """A request parameter the route does not take: answered with 400 and this message."""


def _shown(value: str) -> str:
    return repr(value[:_SHOWN]) + ("..." if len(value) > _SHOWN else "")


def number(
    value: str | None,
    name: str,
    *,
    default: int | None = None,
    low: int = 0,
    high: int = MAX_NUMBER,
) -> int:
    """``value`` as a whole number within ``low``..``high``; ``default`` when empty or absent."""
    if value is None or value == "":
        if default is None:
            raise BadInput(f"{name}: required")
        return default
    if len(value) > len(str(high)) or not (value.isascii() and value.isdigit()):
        raise BadInput(f"{name}: expected a whole number from {low} to {high}, got {_shown(value)}")
    found = int(value)
    if not low <= found <= high:
        raise BadInput(f"{name}: expected a whole number from {low} to {high}, got {found}")
    return found


def numbers(values: list[str], name: str, *, low: int = 1) -> list[int]:
    """Every value of a repeated parameter (such as checked boxes), each a number."""
    if len(values) > MAX_SELECTED:
        raise BadInput(f"{name}: at most {MAX_SELECTED} at once, got {len(values)}")
    return [number(v, name, low=low) for v in values]


def text(value: str | None, name: str, *, limit: int) -> str:
    """``value`` stripped, at most ``limit`` characters ("" when absent)."""
    found = (value or "").strip()
    if len(found) > limit:
        raise BadInput(f"{name}: at most {limit} characters, got {len(found)}")
    return found


def choice(value: str | None, name: str, options: tuple[str, ...]) -> str:
    """One of ``options``, or "" when empty or absent."""
    found = (value or "").strip()
    if found and found not in options:
        raise BadInput(f"{name}: expected one of {', '.join(options)}, got {_shown(found)}")
    return found


def since(value: str | None, *, now: datetime | None = None) -> datetime | None:
    """``since`` as minutes ago (``15``) or an ISO time (``2026-11-27T10:00``); None when empty."""
    found = text(value, "since", limit=64)
    if not found:
        return None
    if found.isascii() and found.isdigit():
        minutes = number(found, "since", high=MAX_SINCE_MINUTES)
        return (now or datetime.now(UTC)) - timedelta(minutes=minutes)
    try:
        moment = datetime.fromisoformat(found)
    except ValueError:
        raise BadInput(
            f"since: expected minutes ago (15) or a time (2026-11-27T10:00), got {_shown(found)}"
        ) from None
    try:  # a time near year 1 or 9999 in another zone has no UTC form
        return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).astimezone(UTC)
    except OverflowError:
        raise BadInput(f"since: {_shown(found)} is out of range") from None
