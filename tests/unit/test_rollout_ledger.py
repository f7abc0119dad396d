"""The job controller's working state: the cursor over a job's targets, the counts it keeps
instead of passes over every node, the attempts in send order, and the pacing of sends."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from meshforge.control.jobs import NODE_STATES, NodeJob
from meshforge.control.rollout import Ledger, Pacer, figures

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def _targets(n: int) -> list[tuple[str, str]]:
    return [("s", f"n{i}") for i in range(n)]


def _at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat()


def _send(ledger: Ledger, record: NodeJob, at: float) -> NodeJob:
    sent = record.to("IN_PROGRESS", attempt=record.attempt + 1, sent_at=_at(at))
    ledger.put(sent)
    return sent


def test_the_cursor_gives_each_queued_target_once_in_order() -> None:
    ledger = Ledger(_targets(5), {})
    order = []
    while (record := ledger.next_queued()) is not None:
        order.append(record.node)
        _send(ledger, record, 0)
    assert order == ["n0", "n1", "n2", "n3", "n4"]
    assert ledger.next_queued() is None and ledger.count("IN_PROGRESS") == 5


def test_a_restart_skips_what_the_bucket_says_was_sent_or_done() -> None:
    stored = {
        "s.n0": NodeJob("s", "n0", "SUCCEEDED", attempt=1),
        "s.n2": NodeJob("s", "n2", "IN_PROGRESS", attempt=1, sent_at=_at(0)),
    }
    ledger = Ledger(_targets(4), stored)
    assert [ledger.next_queued(), ledger.next_queued(), ledger.next_queued()] == [
        NodeJob("s", "n1", updated_at=ledger.records["s.n1"].updated_at),
        NodeJob("s", "n3", updated_at=ledger.records["s.n3"].updated_at),
        None,
    ]
    assert not ledger.finished and ledger.count("QUEUED") == 2


def test_a_node_put_back_in_the_queue_comes_before_the_rest_and_only_once() -> None:
    ledger = Ledger(_targets(4), {})
    first = _send(ledger, ledger.next_queued() or NodeJob("x", "x"), 0)
    ledger.put(first.to("FAILED", by_reply=True))
    ledger.put(ledger.records["s.n0"].to("QUEUED"))
    assert (ledger.next_queued() or first).node == "n0"
    assert [r.node for r in iter(ledger.next_queued, None)] == ["n1", "n2", "n3"]


def test_a_node_queued_again_behind_the_cursor_is_not_given_twice() -> None:
    ledger = Ledger(_targets(2), {"s.n1": NodeJob("s", "n1", "FAILED", attempt=1)})
    ledger.put(ledger.records["s.n1"].to("QUEUED"))  # a restart's retry: also ahead of the cursor
    given_out = []
    while (record := ledger.next_queued()) is not None:
        given_out.append(record.node)
        _send(ledger, record, 0)
    assert sorted(given_out) == ["n0", "n1"]


def test_targets_without_a_record_are_queued_and_strays_are_ignored() -> None:
    stray = {"other.x": NodeJob("other", "x")}
    ledger = Ledger(_targets(2), stray)
    assert set(ledger.records) == {"s.n0", "s.n1"} and ledger.count("QUEUED") == 2


def test_overdue_gives_the_attempts_past_their_timeout_oldest_first_skipping_answered() -> None:
    ledger = Ledger(_targets(4), {})
    sent = [_send(ledger, r, i) for i, r in enumerate(iter(ledger.next_queued, None))]
    ledger.put(sent[0].to("SUCCEEDED", by_reply=True))  # answered: never overdue
    overdue = list(ledger.overdue(T0 + timedelta(seconds=12.5), timeout=10))
    assert [r.node for r in overdue] == ["n1", "n2"]
    assert list(ledger.overdue(T0 + timedelta(seconds=12.5), timeout=10)) == []  # given once
    for record in overdue:
        ledger.put(record.to("TIMED_OUT"))
    assert ledger.oldest_in_progress() == _at(3)


def test_a_new_attempt_is_timed_from_its_own_send() -> None:
    ledger = Ledger(_targets(1), {})
    first = _send(ledger, ledger.next_queued() or NodeJob("x", "x"), 0)
    ledger.put(first.to("TIMED_OUT"))
    ledger.put(ledger.records["s.n0"].to("QUEUED"))
    _send(ledger, ledger.next_queued() or first, 20)
    assert list(ledger.overdue(T0 + timedelta(seconds=25), timeout=10)) == []
    assert [r.attempt for r in ledger.overdue(T0 + timedelta(seconds=31), timeout=10)] == [2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.sampled_from(NODE_STATES)), max_size=60))
def test_counts_and_figures_match_a_pass_over_every_record(
    changes: list[tuple[int, str]],
) -> None:
    ledger = Ledger(_targets(10), {})
    for step, (index, state) in enumerate(changes):
        record = ledger.records[f"s.n{index}"]
        attempt = record.attempt + 1 if state == "IN_PROGRESS" else record.attempt
        ledger.put(record.to(state, attempt=attempt, sent_at=_at(step)))  # type: ignore[arg-type]
    now = T0 + timedelta(seconds=100)
    assert ledger.figures(now) == figures(ledger.records, now)
    assert ledger.finished == all(r.terminal for r in ledger.records.values())


def test_the_pacer_keeps_the_schedule_and_makes_up_a_late_wake_up() -> None:
    pacer = Pacer(6000)  # 100/s: a slot every 10 ms
    assert pacer.take(100.0, most=50) == 1
    assert pacer.take(100.005, most=50) == 0 and abs(pacer.wait(100.005) - 0.005) < 1e-9
    assert pacer.take(100.023, most=50) == 2  # woke 13 ms late: the 10 and 20 ms slots go now
    assert abs(pacer.wait(100.023) - 0.007) < 1e-9  # the 30 ms slot is still where it was


def test_the_pacer_does_not_make_up_a_long_stall_nor_crowd_slow_sends() -> None:
    fast = Pacer(6000)  # 100/s: up to 0.2 s of delay made up
    fast.take(0.0, most=1000)
    assert 20 <= fast.take(1.0, most=1000) <= 21  # a 1 s stall: the slots of its last 0.2 s go
    assert fast.take(1.0, most=1000) + fast.take(1.0, most=1000) <= 1 and fast.wait(1.0) <= 0.0101
    slow = Pacer(120)  # a slot every 0.5 s
    slow.take(0.0, most=10)
    assert slow.take(0.8, most=10) == 1  # 0.3 s late
    assert slow.wait(0.8) >= 0.45 - 1e-9  # the next one still 0.45 s later at least


def test_the_pacer_sends_at_the_asked_rate_over_many_slots() -> None:
    pacer = Pacer(30_000)  # 500/s
    now, sent = 0.0, 0
    while sent < 5000:
        sent += pacer.take(now, most=256)
        now += max(pacer.wait(now), 0.001) + 0.0007  # every wake-up 0.7 ms late
    assert abs(sent / now - 500) <= 50


def test_without_a_rate_everything_goes_at_once() -> None:
    assert Pacer(None).take(0.0, most=256) == 256
    assert Pacer(None).take(0.0, most=0) == 0


def test_a_node_taken_but_not_sent_is_given_out_again_first() -> None:
    ledger = Ledger(_targets(3), {})
    taken = ledger.next_queued() or NodeJob("x", "x")
    ledger.again(taken)  # its command was not acknowledged in time
    assert [r.node for r in iter(ledger.next_queued, None)] == ["n0", "n1", "n2"]


def test_the_pacer_makes_up_more_delay_the_faster_it_sends() -> None:
    assert [Pacer(r * 60).catch_up for r in (1, 25, 100, 500, 5000)] == [0.05, 0.05, 0.2, 1.0, 1.0]
    ten = Pacer(600)  # 10/s: one at a time, whatever the wake-ups
    assert ten.take(0.0, most=5) == 1 and ten.take(0.149, most=5) == 1
    assert ten.take(0.19, most=5) == 0  # the next slot keeps its place (0.2): never two at once
    assert ten.take(0.2, most=5) == 1
