"""Named crash points for the crash suite, armed only by a test-only setting.

``MESHFORGE_CRASH_AT=after_commit`` makes the process kill itself with SIGKILL the first
time it reaches ``crash_point("after_commit")``; ``MESHFORGE_CRASH_AT=after_commit:7``
on the 7th time. Unset, a crash point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["CRASH_POINTS", "JOB_CRASH_POINTS", "crash_point"]

# The effect loop's points: tests/chaos/test_crash_points.py kills a worker at each.
CRASH_POINTS = (
    "after_fetch",
    "after_enqueue",  # waiting for the commit stage
    "after_handler",
    "after_commit",
    "after_commit_while_publishing",  # the group before is still publishing
    "before_publish",  # the publish stage's turn came, nothing of the group sent yet
    "after_partial_publish",
    "after_publish",
    "after_ack",
)
# A job controller's (tests/integration/test_fleet_jobs.py).
JOB_CRASH_POINTS = (
    "job_after_send",  # a job's command is in the mailbox, its node's state not yet written
)


def _armed() -> tuple[str, int] | None:
    spec = os.environ.get("MESHFORGE_CRASH_AT")
    if not spec:
        return None
    name, _, nth = spec.partition(":")
    return name, int(nth) if nth else 1


_ARMED = _armed()
_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Die here with SIGKILL if MESHFORGE_CRASH_AT names this point (and its count is reached)."""
    if _ARMED is None or _ARMED[0] != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= _ARMED[1]:
        os.kill(os.getpid(), signal.SIGKILL)
