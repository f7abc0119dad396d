"""The hold's bookkeeping, without a server: who waits, for how long, and what counts."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from meshforge.consume.decisions import Delivery
from meshforge.envelope import Envelope
from meshforge.runtime.effects import Work
from meshforge.runtime.holds import STOPPED_POLL, Holds
from meshforge.topology.scope import Scope

A = Scope("acme", "shop")


def work(seq: int, resource: str, *, delivered: int = 1, key: str | None = None) -> Work:
    env = Envelope.new("t.do", {}, source="test", idempotency_key=key or f"k{seq}")
    delivery = Delivery(msg=None, subject="cmd.acme.shop.t.do", data=b"", headers={},  # type: ignore[arg-type]
                        stream="S", seq=seq, num_delivered=delivered, timestamp=datetime.now(UTC))  # fmt: skip
    return Work(0, delivery, env, None, resource, A)  # type: ignore[arg-type]


def seqs(items: list[Any]) -> list[int]:
    return [(w[0] if isinstance(w, tuple) else w).delivery.seq for w in items]


def test_nothing_else_outstanding_is_quiet_and_runs_everything() -> None:
    holds = Holds("c")
    group = [work(1, "a"), work(2, "a"), work(3, "b")]
    holds.arrive(group)
    assert holds.quiet(group[2:]) and not holds.quiet(group)
    run, held = holds.split(group)
    assert seqs(run) == [1, 2, 3] and held == []


def test_a_command_nakd_earlier_holds_the_later_ones_of_its_resource_only() -> None:
    holds = Holds("c")
    head = work(1, "a")
    holds.arrive([head])
    holds.away((A, "a"), 1, 2.0)
    later = [work(2, "a"), work(3, "b"), work(4, "a")]
    holds.arrive(later)
    run, held = holds.split(later)
    assert seqs(run) == [3]
    assert seqs(held) == [2, 4]
    assert all(2.0 <= delay <= 2.5 for _, delay in held)  # just after the head is due
    assert holds.held_now()[0] == 2
    holds.settle((A, "a"), 1)  # the head applied
    holds.arrive(later)
    run, held = holds.split(later)
    assert seqs(run) == [2, 3, 4] and held == []


def test_an_earlier_command_in_the_same_group_runs_first_instead() -> None:
    holds = Holds("c")
    group = [work(5, "a"), work(6, "a")]
    holds.arrive(group)
    assert holds.split(group) == (group, [])


def test_a_seeded_blocker_of_unknown_due_time_is_looked_at_again_soon() -> None:
    holds = Holds("c")
    holds.seed([((A, "a"), 1)], due_in=60.0)
    later = work(2, "a")
    holds.arrive([later])
    _, held = holds.split([later])
    assert seqs(held) == [2] and held[0][1] <= 2.0


async def test_a_blocker_the_stream_no_longer_has_is_dropped() -> None:
    asked: list[int] = []

    async def present(seq: int) -> bool:
        asked.append(seq)
        return False

    holds = Holds("c", present=present)
    holds.seed([((A, "a"), 1)], due_in=-5.0)  # overdue
    later = work(2, "a")
    holds.arrive([later])
    await holds.recheck([later])
    assert asked == [1]
    assert holds.split([later]) == ([later], [])


def test_held_deliveries_are_not_attempts() -> None:
    holds = Holds("c")
    assert holds.attempts(A, "k", 4) == 4
    holds.counts[(A, "k")] = 3
    assert holds.attempts(A, "k", 4) == 1
    assert holds.attempts(A, "other", 4) == 4
    holds.forget(A, "k")
    assert holds.attempts(A, "k", 4) == 4


@pytest.mark.parametrize("key, waits", [("head", False), ("other", True)])
def test_a_stopped_resource_waits_for_its_dead_lettered_head(key: str, waits: bool) -> None:
    holds = Holds("c")
    holds.stopped[(A, "a")] = "head"
    w = work(9, "a", key=key)
    holds.arrive([w])
    assert not holds.quiet([w])
    run, held = holds.split([w])
    assert (held[0][1] == STOPPED_POLL) if waits else (run == [w])
    holds.applied((A, "a"), "head")
    assert holds.stopped == {}
