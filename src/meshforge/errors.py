"""One exception hierarchy: every error MeshForge raises is a ``MeshForgeError``.

Each message is one line a person can act on: it names the field, the value and what
was expected.
"""

from __future__ import annotations


class MeshForgeError(Exception):
    """Root of every error MeshForge raises on purpose."""


class ConfigError(MeshForgeError):
    """A setting has a value that cannot be used."""


class InvalidSubject(MeshForgeError):
    """A subject or token breaks the subject rules (see CONTRACT.md)."""


class MalformedMessage(MeshForgeError):
    """A message body is not a valid envelope; it is dead-lettered as ``malformed``."""


class ServerError(MeshForgeError):
    """The embedded nats-server could not be started or stopped."""


class ConnectionFailed(MeshForgeError):
    """No connection to NATS could be made."""


class TopologyError(MeshForgeError):
    """Streams or consumers are missing, overlapping, or cannot be updated."""


class OverlapError(TopologyError):
    """Two streams would capture the same subject."""


class MissingTopology(TopologyError):
    """A stream or consumer the runtime needs does not exist (least-privilege mode)."""


class PublishError(MeshForgeError):
    """A publish failed; ``retriable`` says whether trying again may succeed."""

    retriable: bool = False

    def __init__(self, message: str, *, kind: str = "error", retriable: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.retriable = retriable


class StoreError(MeshForgeError):
    """The store failed or holds data that contradicts the wire.

    ``kind`` is ``duplicate`` (a unique key already stored), ``conflict`` (serialisation
    failure or deadlock), ``busy``, ``unavailable``, ``not_found``, ``constraint``,
    ``invalid`` (a value this database can never store: NUL in text, out of range),
    ``closed`` or ``error``;
    ``retriable`` says whether running the whole transaction again may succeed.
    """

    retriable: bool = False

    def __init__(self, message: str, *, kind: str = "error", retriable: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.retriable = retriable


class HandlerTimeout(MeshForgeError, TimeoutError):
    """A handler ran past its own time limit: a transient failure, retried with backoff."""


class HandlerError(MeshForgeError):
    """Base of the errors a handler raises to choose what happens to its message."""


class Unrecoverable(HandlerError):
    """Retrying cannot help: the message is dead-lettered as ``unrecoverable`` at once."""


class InvalidPayload(Unrecoverable):
    """A payload does not fit the type its command declares: dead-lettered as
    ``invalid_payload`` at once, its text naming the field path and the expected type."""


class Retry(HandlerError):
    """Transient failure: nak the message, redelivered after ``delay`` seconds (or the backoff)."""

    def __init__(self, message: str = "retry requested", *, delay: float | None = None) -> None:
        super().__init__(message)
        self.delay = delay


class Rejected(HandlerError):
    """The message was refused on purpose (e.g. epoch mismatch): dead-lettered as ``rejected``."""


class Expired(HandlerError):
    """The message's deadline passed before it could run: dead-lettered as ``expired``."""


def one_line(exc: BaseException, limit: int = 1024) -> str:
    """``Class: message`` on one line, cut to ``limit`` bytes of UTF-8."""
    text = f"{type(exc).__name__}: {exc}".replace("\r", " ").replace("\n", " ")
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    return raw[: limit - 3].decode("utf-8", "ignore") + "..."
