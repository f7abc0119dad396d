"""A node's reply to a control command: the ``control.reply`` envelope and its parsed form.

Every command gets exactly one reply. Its id is derived from the command's id, so a
reply sent again after a crash is the same message (the server's duplicate window and
the stored reply both see to that).

Example::

    env = reply_envelope(command, site="lab1", node="node7", status="ok",
                         result={"pong": True}, error=None, node_epoch=3)
    reply = Reply.from_envelope(env)
    assert reply.command_id == command.id and reply.ok
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from meshforge.envelope import Envelope, now_ts
from meshforge.errors import MalformedMessage

__all__ = ["REPLY_TYPE", "STATUSES", "Reply", "Status", "reply_envelope"]

REPLY_TYPE = "control.reply"
Status = Literal["ok", "error", "expired", "rejected", "canceled"]
STATUSES: tuple[str, ...] = get_args(Status)


def reply_envelope(
    command: Envelope,
    *,
    site: str,
    node: str,
    status: Status,
    result: Any,
    error: str | None,
    node_epoch: int | None,
) -> Envelope:
    """The reply to ``command``: type ``control.reply``, ``causation_id`` = the command's id,
    an id derived from it, and payload ``{"status", "result", "error", "node_epoch"}``."""
    payload = {"status": status, "result": result, "error": error, "node_epoch": node_epoch}
    return command.child(
        REPLY_TYPE,
        payload,
        position=0,
        source=f"node:{site}.{node}",
        resource_type="node",
        resource_id=f"{site}.{node}",
        ts=now_ts(),
    )


@dataclass(frozen=True, slots=True)
class Reply:
    """A parsed reply. ``ok`` is true for status ``ok``."""

    command_id: str
    status: Status
    result: Any
    error: str | None
    node_epoch: int | None
    envelope: Envelope

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_envelope(cls, env: Envelope) -> Reply:
        """Parse a ``control.reply`` envelope; raises MalformedMessage if it is not one."""
        if env.type != REPLY_TYPE:
            raise MalformedMessage(f"'type' is {env.type!r}, expected {REPLY_TYPE!r}")
        if not env.causation_id:
            raise MalformedMessage("reply lacks 'causation_id'")
        status = env.payload.get("status")
        if status not in STATUSES:
            raise MalformedMessage(f"reply 'status' is {status!r}, expected one of {STATUSES}")
        epoch = env.payload.get("node_epoch")
        error = env.payload.get("error")
        return cls(
            command_id=env.causation_id,
            status=status,
            result=env.payload.get("result"),
            error=error if isinstance(error, str) else None,
            node_epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
            envelope=env,
        )

    def to_dict(self) -> dict[str, Any]:
        """The reply as plain data, e.g. for printing as JSON."""
        return {
            "command_id": self.command_id,
            "status": self.status,
            "result": self.result,
            "error": self.error,
            "node_epoch": self.node_epoch,
            "reply_id": self.envelope.id,
            "ts": self.envelope.ts,
        }
