"""Building, validating and matching subjects (CONTRACT.md, "Subjects").

A token is 1 to 64 characters of ``A-Z a-z 0-9 _ -``; a subject is at most 255
characters. Wildcards (``*`` one token, ``>`` the rest) appear only in patterns.

Example::

    >>> command_subject("default", "demo", "order", "create")
    'cmd.default.demo.order.create'
    >>> matches("cmd.*.*.order.>", "cmd.default.demo.order.create")
    True
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from meshforge.errors import InvalidSubject

__all__ = [
    "JOBS_BUCKET",
    "NODES_BUCKET",
    "STREAM_COMMANDS",
    "STREAM_CONTROL",
    "STREAM_EVENTS",
    "STREAM_FAILED",
    "STREAM_REPLIES",
    "command_parts",
    "command_subject",
    "control_command_subject",
    "control_reply_subject",
    "dead_letter_subject",
    "event_subject",
    "find_overlaps",
    "matches",
    "original_of_dead_letter",
    "overlaps",
    "partitioned_command_subject",
    "validate_subject",
    "validate_token",
]

STREAM_COMMANDS = "MESHFORGE_COMMANDS"
STREAM_EVENTS = "MESHFORGE_EVENTS"
STREAM_FAILED = "MESHFORGE_FAILED"
STREAM_CONTROL = "MESHFORGE_CONTROL"
STREAM_REPLIES = "MESHFORGE_REPLIES"
# The control plane's key-value buckets: named here so permissions need not import it.
NODES_BUCKET = "MESHFORGE_NODES"
JOBS_BUCKET = "MESHFORGE_JOBS"

MAX_SUBJECT = 255
MAX_TOKEN = 64
DEAD_LETTER_PREFIX = "failed."
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def validate_token(token: str, what: str = "token") -> str:
    """Return ``token`` if it is a valid subject token, else raise InvalidSubject."""
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise InvalidSubject(
            f"invalid {what} {token!r}: expected 1 to {MAX_TOKEN} characters of A-Z a-z 0-9 _ -"
        )
    return token


def validate_subject(subject: str, *, wildcards: bool = False) -> str:
    """Return ``subject`` if valid for publishing (or, with ``wildcards``, for filtering).

    Refused: empty tokens, spaces or control characters, wildcards when publishing,
    a ``>`` that is not the last token, and more than 255 characters.
    """
    if not isinstance(subject, str) or not subject:
        raise InvalidSubject(f"invalid subject {subject!r}: it is empty")
    if len(subject) > MAX_SUBJECT:
        raise InvalidSubject(
            f"invalid subject {subject[:40]!r}...: {len(subject)} characters, at most {MAX_SUBJECT}"
        )
    tokens = subject.split(".")
    for i, token in enumerate(tokens):
        if token in ("*", ">"):
            if not wildcards:
                raise InvalidSubject(
                    f"invalid subject {subject!r}: wildcard {token!r} cannot be published to"
                )
            if token == ">" and i != len(tokens) - 1:
                raise InvalidSubject(f"invalid subject {subject!r}: '>' must be the last token")
            continue
        if not _TOKEN.fullmatch(token):
            raise InvalidSubject(
                f"invalid subject {subject!r}: token {token!r} must be 1 to {MAX_TOKEN} "
                "characters of A-Z a-z 0-9 _ -"
            )
    return subject


def _build(*tokens: str) -> str:
    try:
        return _built(tokens)
    except TypeError:  # a token that is not even hashable: the checks name it
        return _checked(tokens)


@functools.lru_cache(maxsize=4096)  # a deployment builds the same few subjects again and again
def _built(tokens: tuple[str, ...]) -> str:
    return _checked(tokens)


def _checked(tokens: tuple[str, ...]) -> str:
    for token in tokens:
        validate_token(token)
    return validate_subject(".".join(tokens))


def command_subject(tenant: str, namespace: str, agent: str, command: str) -> str:
    """``cmd.<tenant>.<namespace>.<agent>.<command>``."""
    return _build("cmd", tenant, namespace, agent, command)


def partitioned_command_subject(
    tenant: str, namespace: str, agent: str, command: str, partition: int
) -> str:
    """``cmd.<tenant>.<namespace>.<agent>.<command>.<partition>``: a command to a partitioned agent.

    >>> partitioned_command_subject("default", "demo", "order", "create", 3)
    'cmd.default.demo.order.create.3'
    """
    if isinstance(partition, bool) or not isinstance(partition, int) or partition < 0:
        raise InvalidSubject(f"invalid partition {partition!r}: expected an integer >= 0")
    return _build("cmd", tenant, namespace, agent, command, str(partition))


def command_parts(subject: str) -> tuple[str, str, str, str, int | None] | None:
    """``(tenant, namespace, agent, command, partition)`` of a command subject, else None.

    A command subject has five tokens, or six when the sixth is its partition (digits).

    >>> command_parts("cmd.default.demo.order.create.3")
    ('default', 'demo', 'order', 'create', 3)
    >>> command_parts("cmd.default.demo.order.create")
    ('default', 'demo', 'order', 'create', None)
    """
    tokens = subject.split(".")
    if tokens[0] != "cmd" or len(tokens) not in (5, 6) or not all(tokens[1:5]):
        return None
    partition: int | None = None
    if len(tokens) == 6:
        if not tokens[5].isascii() or not tokens[5].isdigit():
            return None
        partition = int(tokens[5])
    return tokens[1], tokens[2], tokens[3], tokens[4], partition


def event_subject(tenant: str, namespace: str, agent: str, event: str) -> str:
    """``evt.<tenant>.<namespace>.<agent>.<event>``."""
    return _build("evt", tenant, namespace, agent, event)


def control_command_subject(site: str, node: str) -> str:
    """``control.cmd.<site>.<node>``: a node's mailbox."""
    return _build("control", "cmd", site, node)


def control_reply_subject(site: str, node: str) -> str:
    """``control.reply.<site>.<node>``: where a node's replies go."""
    return _build("control", "reply", site, node)


def dead_letter_subject(original: str) -> str:
    """``failed.<original subject>``; a subject too long to prefix is refused."""
    return validate_subject(DEAD_LETTER_PREFIX + validate_subject(original))


def original_of_dead_letter(subject: str) -> str:
    """The original subject of a dead letter's ``failed.<...>`` subject."""
    if not subject.startswith(DEAD_LETTER_PREFIX):
        raise InvalidSubject(
            f"invalid dead-letter subject {subject!r}: expected 'failed.<subject>'"
        )
    return subject[len(DEAD_LETTER_PREFIX) :]


def matches(pattern: str, subject: str) -> bool:
    """Whether the literal ``subject`` matches ``pattern`` (``*`` and ``>`` wildcards)."""
    p_tokens = pattern.split(".")
    s_tokens = subject.split(".")
    for i, p in enumerate(p_tokens):
        if p == ">":
            return len(s_tokens) > i
        if i >= len(s_tokens):
            return False
        if p != "*" and p != s_tokens[i]:
            return False
    return len(p_tokens) == len(s_tokens)


def overlaps(a: str, b: str) -> bool:
    """Whether some literal subject matches both patterns ``a`` and ``b``."""
    a_tokens = a.split(".")
    b_tokens = b.split(".")
    for i in range(max(len(a_tokens), len(b_tokens))):
        x = a_tokens[i] if i < len(a_tokens) else None
        y = b_tokens[i] if i < len(b_tokens) else None
        if x == ">" or y == ">":
            # '>' needs at least one token on the other side (or the other is a '>').
            return x is not None and y is not None
        if x is None or y is None:
            return False
        if x != "*" and y != "*" and x != y:
            return False
    return True


def find_overlaps(subjects_a: Iterable[str], subjects_b: Iterable[str]) -> list[tuple[str, str]]:
    """Every pair (one from each set) that some subject would match both of."""
    b_list = list(subjects_b)
    return [(a, b) for a in subjects_a for b in b_list if overlaps(a, b)]
