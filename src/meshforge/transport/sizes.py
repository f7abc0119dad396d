"""Message sizes: what the server accepts, and the one function that makes a message fit.

Two limits apply to every JetStream publish:

* ``max_payload`` (the server's INFO): the header block plus the body. The server answers
  a bigger message with ``-ERR 'Maximum Payload Violation'`` and closes the connection,
  so nothing over it may be sent.
* 65,535 bytes of header block (JetStream stores the header length as 16 bits and refuses
  more with "header size exceeds maximum allowed of 64k").

Header sizes are counted as the client writes them: ``NATS/1.0\\r\\n``, one
``Name: value\\r\\n`` line per header, and a closing ``\\r\\n``.

Example::

    limits = SizeLimits(max_payload=1024 * 1024)
    fitted = fit_message("failed.cmd.default.demo.order.create", body, headers, limits,
                         mark="Dlq-Truncated", keep={"Dlq-Reason"})
    if fitted.cut:
        print("truncated:", fitted.cut)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from meshforge.errors import PublishError

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "HEADER_LIMIT",
    "Fitted",
    "SizeLimits",
    "check_fits",
    "fit_message",
    "header_size",
]

#: JetStream's header limit: the header block's length must fit in 16 bits.
HEADER_LIMIT = 65_535
#: The server's default ``max_payload`` (1 MiB), used until INFO says otherwise.
DEFAULT_MAX_PAYLOAD = 1_048_576

_HEADER_BLOCK = len(b"NATS/1.0\r\n") + len(b"\r\n")
_LINE = len(b": ") + len(b"\r\n")
# A truncation note names at most this many characters of dropped header names.
_DROPPED_NAMES = 400


@dataclass(frozen=True, slots=True)
class SizeLimits:
    """The limits a message must respect: ``max_payload`` (headers + body) and the header block."""

    max_payload: int = DEFAULT_MAX_PAYLOAD
    max_headers: int = HEADER_LIMIT


@dataclass(frozen=True, slots=True)
class Fitted:
    """A message that fits. ``cut`` is empty when nothing was changed, else what was cut
    (the value of the ``mark`` header, e.g. ``body=1048476;kept=1047900;headers=412;dropped=``)."""

    data: bytes
    headers: dict[str, str]
    cut: str = ""


def header_size(headers: Mapping[str, str]) -> int:
    """Bytes of the header block the client sends for ``headers`` (0 for no headers)."""
    if not headers:
        return 0
    # One pass in C over the names and one over the values (every output of every command
    # is measured): ASCII text is as long in UTF-8 as in characters.
    values = "".join(headers.values())
    size = len(values) if values.isascii() else len(values.encode())
    return _HEADER_BLOCK + len(headers) * _LINE + len("".join(headers)) + size


def _names(dropped: list[str]) -> str:
    text = ",".join(dropped)
    if len(text) <= _DROPPED_NAMES:
        return text
    shown: list[str] = []
    used = 0
    for name in dropped:
        if used + len(name) + 1 > _DROPPED_NAMES:
            break
        shown.append(name)
        used += len(name) + 1
    return ",".join(shown) + f",+{len(dropped) - len(shown)}more"


def fit_message(
    subject: str,
    data: bytes,
    headers: Mapping[str, str],
    limits: SizeLimits,
    *,
    mark: str | None = None,
    keep: Collection[str] = (),
) -> Fitted:
    """``data`` and ``headers`` as they can be sent to ``subject`` under ``limits``.

    A message within the limits comes back unchanged (``cut == ""``). Without ``mark``, a
    message over a limit raises ``PublishError`` (kind ``payload_too_large``) naming the
    subject, the sizes and the limit: nothing is sent. With ``mark``, it is truncated: the
    longest headers not named in ``keep`` (case-insensitive) are dropped until the header
    block fits, the body is cut to the room left, and header ``mark`` says what was cut and
    the original sizes: ``body=<bytes>;kept=<body bytes kept>;headers=<bytes>;dropped=<names>``.
    Raises ``PublishError`` when even the kept headers cannot fit.
    """
    hsize = header_size(headers)
    if hsize <= limits.max_headers and hsize + len(data) <= limits.max_payload:
        return Fitted(data, dict(headers))
    if mark is None:
        raise _too_large(subject, len(data), hsize, limits)
    kept = dict(headers)
    kept.pop(mark, None)
    protected = {name.lower() for name in keep}
    dropped: list[str] = []

    def note(body: int) -> str:
        return f"body={len(data)};kept={body};headers={hsize};dropped={_names(dropped)}"

    while True:
        # The note is sized for the whole body: a cut body only shortens it.
        trial = {**kept, mark: note(len(data))}
        size = header_size(trial)
        if size <= limits.max_headers and size < limits.max_payload:
            break
        droppable = [name for name in kept if name.lower() not in protected]
        if not droppable:
            raise PublishError(
                f"message to {subject!r} cannot be made to fit: its kept headers alone are "
                f"{size} bytes (limits: headers {limits.max_headers}, "
                f"max_payload {limits.max_payload})",
                kind="payload_too_large",
            )
        longest = max(droppable, key=lambda name: len(name) + len(kept[name]))
        dropped.append(longest)
        del kept[longest]
    body = data[: limits.max_payload - size]
    kept[mark] = note(len(body))
    return Fitted(body, kept, kept[mark])


def check_fits(subject: str, data: bytes, headers: Mapping[str, str], limits: SizeLimits) -> None:
    """Raise ``PublishError`` (kind ``payload_too_large``) unless the message fits ``limits``."""
    hsize = header_size(headers)
    if hsize > limits.max_headers or hsize + len(data) > limits.max_payload:
        raise _too_large(subject, len(data), hsize, limits)


def _too_large(subject: str, body: int, headers: int, limits: SizeLimits) -> PublishError:
    if headers > limits.max_headers:
        what = (
            f"its headers are {headers} bytes, over JetStream's header limit of "
            f"{limits.max_headers} bytes: send fewer or shorter headers"
        )
    else:
        what = (
            f"it is {headers + body} bytes (headers {headers} + body {body}), over the "
            f"server's max_payload of {limits.max_payload} bytes: send less, or raise "
            "max_payload in the server configuration"
        )
    return PublishError(f"message to {subject!r} not sent: {what}", kind="payload_too_large")
