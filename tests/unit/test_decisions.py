"""Decisions as a handler builds them (what errors become: test_failure_policy.py)."""

from __future__ import annotations

from meshforge.consume.decisions import Action, Decision


def test_decision_constructors() -> None:
    assert Decision.ack().action is Action.ACK
    assert Decision.nak().delay is None and Decision.nak(0).delay == 0
    assert Decision.term().action is Action.TERM
    assert Decision.in_progress().action is Action.IN_PROGRESS
    dl = Decision.dead_letter("rejected", ValueError("a\nb"))
    assert dl.error == "ValueError: a b" and dl.reason == "rejected"
