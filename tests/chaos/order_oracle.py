"""The order checker's oracle: what a run must show, per resource, whatever the faults were.

Given the commands as stored (their stream sequence), the dead letters, the store's
states and event log, and every message of the events stream, ``check`` lists each
violation of the contract's two promises:

* order: each resource's applied sequence (its state, its event log, and the ``at``
  positions its events carry on the wire) is its commands in stream order minus the
  dead-lettered ones;
* exactly once: each applied command has one event, stored ONCE in the events stream
  (messages are counted per ``Nats-Msg-Id``, never compared as sets), a dead-lettered
  command has no event and one dead letter, and only the commands planned to fail for
  good are dead-lettered.

Wire arrival order is reported (``inversions``) but not judged: an event whose first
publish was lost to a crash is re-published on redelivery, after later events.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass, field

__all__ = ["Command", "Outcome", "WireEvent", "check"]


@dataclass(frozen=True, slots=True)
class Command:
    """One published command: its resource, its number there, where it was stored, its plan."""

    id: str
    resource: str
    n: int
    seq: int
    plan: str = ""  # e.g. "fail=1 retry=2 sleep=0.5 fatal", for the diff
    fatal: bool = False


@dataclass(frozen=True, slots=True)
class WireEvent:
    """One message of the events stream."""

    msg_id: str
    causation_id: str
    n: int
    at: int
    seq: int


@dataclass
class Outcome:
    """What ``check`` found: the violations (empty when the run is right) and figures."""

    violations: list[str] = field(default_factory=list)
    applied: int = 0
    dead_lettered: int = 0
    inversions: int = 0  # events on the wire after an event applied later (not a violation)

    @property
    def ok(self) -> bool:
        return not self.violations


def check(
    commands: list[Command],
    *,
    dead_letters: list[str],
    states: dict[str, list[int]],
    log: dict[str, list[int]],
    wire: list[WireEvent],
    left: int = 0,
    ordered: bool = True,
) -> Outcome:
    """Every violation of per-resource order and exactly-once (see the module docstring).

    ``dead_letters``: the command id of each dead-letter message; ``states``/``log``: the
    command numbers in each resource's stored state and in its event log (by position);
    ``wire``: every events-stream message; ``left``: commands still in the stream;
    ``ordered`` False: each command applied once, in any order (workers sharing one
    unpartitioned durable promise no more).
    """
    out = Outcome()
    by_id = {c.id: c for c in commands}
    per_resource: dict[str, list[Command]] = defaultdict(list)
    for c in sorted(commands, key=lambda c: c.seq):
        per_resource[c.resource].append(c)
    if left:
        out.violations.append(f"{left} command(s) never left the commands stream")

    dead_count = Counter(dead_letters)
    for cid, count in sorted(dead_count.items()):
        c = by_id.get(cid)
        if c is None:
            out.violations.append(f"a dead letter names no published command: {cid}")
        elif count > 1:
            out.violations.append(f"{_name(c)} dead-lettered {count} times")
    for c in commands:
        if c.fatal and c.id not in dead_count:
            out.violations.append(
                f"{_name(c)} was planned to fail for good but was not dead-lettered"
            )
        elif not c.fatal and c.id in dead_count:
            out.violations.append(
                f"{_name(c)} was dead-lettered though only transient faults were planned ({c.plan})"
            )
    dead = {cid for cid in dead_count if cid in by_id}
    out.dead_lettered = len(dead)

    copies = Counter(e.msg_id for e in wire)
    for msg_id, count in sorted(copies.items()):
        if count > 1:
            first = next(e for e in wire if e.msg_id == msg_id)
            cause = by_id.get(first.causation_id)
            what = _name(cause) if cause else first.causation_id
            out.violations.append(
                f"event {msg_id} of {what} is stored {count} times in the events stream"
            )
    events_of: dict[str, set[str]] = defaultdict(set)
    wire_of: dict[str, list[WireEvent]] = defaultdict(list)  # first copy of each event, by resource
    for e in wire:
        c = by_id.get(e.causation_id)
        if c is None:
            out.violations.append(f"event {e.msg_id} names no published command ({e.causation_id})")
            continue
        if e.msg_id in events_of[c.id]:
            continue  # a copy: reported above
        events_of[c.id].add(e.msg_id)
        wire_of[c.resource].append(e)
        if e.n != c.n:
            out.violations.append(f"event {e.msg_id} of {_name(c)} says n={e.n}")
    for c in commands:
        ids = events_of.get(c.id, set())
        if c.id in dead and ids:
            out.violations.append(f"{_name(c)} was dead-lettered yet has event(s) {sorted(ids)}")
        elif c.id not in dead and len(ids) != 1:
            out.violations.append(
                f"{_name(c)} has {len(ids)} distinct events (want 1): {sorted(ids)}"
            )

    for resource in sorted(set(per_resource) | set(states) | set(log)):
        cmds = per_resource.get(resource, [])
        want = [c.n for c in cmds if c.id not in dead]
        out.applied += len(want)
        seen = wire_of.get(resource, [])
        on_wire = [e.n for e in sorted(seen, key=lambda e: (e.at, e.seq))]
        ats = sorted(e.at for e in seen)
        wrong = []
        same = (lambda a, b: a == b) if ordered else (lambda a, b: sorted(a) == sorted(b))
        if not same(states.get(resource, []), want):
            wrong.append(("store state", states.get(resource, [])))
        if not same(log.get(resource, []), want):
            wrong.append(("store event log", log.get(resource, [])))
        if not same(on_wire, want) or ats != list(range(len(seen))):
            wrong.append(("events stream by 'at'", on_wire))
        if wrong:
            out.violations.append(_diff(resource, cmds, dead, want, wrong))
        by_seq = [e.at for e in sorted(seen, key=lambda e: e.seq)]
        out.inversions += sum(1 for a, b in itertools.pairwise(by_seq) if b < a)
    return out


def _name(c: Command) -> str:
    return f"{c.resource} n={c.n} (seq {c.seq}, id {c.id})"


def _diff(resource: str, cmds: list[Command], dead: set[str], want: list[int],
          wrong: list[tuple[str, list[int]]]) -> str:  # fmt: skip
    """A resource's violation, readable: what was stored, what had to be applied, what was."""
    lines = [f"resource {resource}: applied out of order, lost or doubled"]
    lines.append("  stored (stream order): " + ", ".join(
        f"n={c.n}@{c.seq}" + (f"[{c.plan}]" if c.plan else "") + (" DEAD" if c.id in dead else "") for c in cmds
    ))  # fmt: skip
    lines.append(f"  must be applied:       {want}")
    for what, got in wrong:
        at = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
            min(len(got), len(want)),
        )
        lines.append(f"  {what + ':':<22} {got}  (first difference at index {at})")
    return "\n".join(lines)
