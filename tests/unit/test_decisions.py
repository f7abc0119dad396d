"""The ack-decision policy: which error becomes which decision, and the nak delays."""

from __future__ import annotations

import pytest

from meshforge.consume.decisions import Action, Decision, backoff_delay, decide
from meshforge.errors import Expired, MalformedMessage, Rejected, Retry, Unrecoverable

BACKOFF = (1.0, 5.0, 10.0)


class Poison(Exception):
    pass


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (MalformedMessage("x"), "malformed"),
        (Unrecoverable("x"), "unrecoverable"),
        (Poison("x"), "unrecoverable"),
        (Rejected("x"), "rejected"),
        (Expired("x"), "expired"),
    ],
)
def test_poison_errors_are_dead_lettered_at_once(exc: Exception, reason: str) -> None:
    decision = decide(exc, 1, max_deliver=5, backoff=BACKOFF, unrecoverable=(Poison,))
    assert decision.action is Action.DEAD_LETTER
    assert decision.reason == reason
    assert decision.error == f"{type(exc).__name__}: x"


def test_transient_errors_nak_with_the_backoff_then_exhaust() -> None:
    delays = [decide(ValueError("x"), n, max_deliver=4, backoff=BACKOFF) for n in (1, 2, 3)]
    assert [d.action for d in delays] == [Action.NAK] * 3
    assert [d.delay for d in delays] == [1.0, 5.0, 10.0]
    last = decide(ValueError("boom"), 4, max_deliver=4, backoff=BACKOFF)
    assert (last.action, last.reason, last.error) == (
        Action.DEAD_LETTER,
        "max_deliveries",
        "ValueError: boom",
    )


def test_retry_takes_its_own_delay_and_none_means_no_client_limit() -> None:
    assert decide(Retry(delay=2.5), 1, max_deliver=5, backoff=BACKOFF).delay == 2.5
    assert decide(Retry(), 2, max_deliver=5, backoff=BACKOFF).delay == 5.0
    assert decide(TimeoutError(), 99, max_deliver=None, backoff=()).delay is None
    assert decide(Retry(delay=1), 5, max_deliver=5, backoff=BACKOFF).reason == "max_deliveries"


def test_backoff_delay_clamps_to_the_schedule() -> None:
    assert backoff_delay(0, BACKOFF) == 1.0
    assert backoff_delay(3, BACKOFF) == 10.0
    assert backoff_delay(30, BACKOFF) == 10.0
    assert backoff_delay(1, ()) is None


def test_decision_constructors() -> None:
    assert Decision.ack().action is Action.ACK
    assert Decision.nak().delay is None and Decision.nak(0).delay == 0
    assert Decision.term().action is Action.TERM
    dl = Decision.dead_letter("rejected", ValueError("a\nb"))
    assert dl.error == "ValueError: a b" and dl.reason == "rejected"
