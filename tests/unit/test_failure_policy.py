"""The failure policy as a table: every cause and error it knows, and what it decides.

Each row is (outcome, policy, expected decision). A property test then runs the policy
over generated outcomes: a nak's delay is never negative nor longer than the schedule's
last entry unless ``Retry`` asked for it; a transient store failure never dead-letters;
every dead letter's reason is one of the contract's.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshforge.consume.decisions import Action, Decision
from meshforge.consume.policy import (
    DEAD_LETTER_RETRY_DELAY,
    REASONS,
    STORE_RETRY_DELAY,
    Cause,
    FailurePolicy,
    Outcome,
    backoff_delay,
)
from meshforge.errors import (
    Expired,
    HandlerTimeout,
    MalformedMessage,
    PublishError,
    Rejected,
    Retry,
    StoreError,
    Unrecoverable,
)

BACKOFF = (1.0, 5.0, 10.0)


class Poison(Exception):
    pass


P = FailurePolicy(max_deliver=4, backoff=BACKOFF, unrecoverable=(Poison,))
NO_LIMIT = FailurePolicy()  # a consumer without a client-side limit or schedule

DISK_FULL = StoreError("database or disk is full", kind="unavailable", retriable=True)
LOCKED = StoreError("database is locked", kind="busy", retriable=True)
CONFLICT = StoreError("could not serialize", kind="conflict", retriable=True)
NUL = StoreError("text cannot contain NUL", kind="invalid")
CORRUPT = StoreError("database disk image is malformed", kind="error")


def nak(delay: float | None) -> Decision:
    return Decision.nak(delay)


def dead(reason: str, error: str) -> Decision:
    return Decision.dead_letter(reason, error)


IN_PROGRESS = Decision.in_progress()

TABLE: list[tuple[str, FailurePolicy, Outcome, Decision]] = [
    # a handler's error
    (
        "malformed",
        P,
        Outcome(Cause.HANDLER, 1, MalformedMessage("x")),
        dead("malformed", "MalformedMessage: x"),
    ),
    (
        "unrecoverable",
        P,
        Outcome(Cause.HANDLER, 1, Unrecoverable("x")),
        dead("unrecoverable", "Unrecoverable: x"),
    ),
    (
        "configured class",
        P,
        Outcome(Cause.HANDLER, 1, Poison("x")),
        dead("unrecoverable", "Poison: x"),
    ),
    ("rejected", P, Outcome(Cause.HANDLER, 1, Rejected("x")), dead("rejected", "Rejected: x")),
    ("expired", P, Outcome(Cause.HANDLER, 1, Expired("x")), dead("expired", "Expired: x")),
    (
        "poison on the last attempt",
        P,
        Outcome(Cause.HANDLER, 4, Rejected("x")),
        dead("rejected", "Rejected: x"),
    ),
    ("transient, 1st", P, Outcome(Cause.HANDLER, 1, RuntimeError("x")), nak(1.0)),
    ("transient, 3rd", P, Outcome(Cause.HANDLER, 3, RuntimeError("x")), nak(10.0)),
    (
        "transient, last",
        P,
        Outcome(Cause.HANDLER, 4, RuntimeError("x")),
        dead("max_deliveries", "RuntimeError: x"),
    ),
    ("timeout", P, Outcome(Cause.HANDLER, 2, HandlerTimeout("slow")), nak(5.0)),
    (
        "timeout, last",
        P,
        Outcome(Cause.HANDLER, 4, HandlerTimeout("slow")),
        dead("max_deliveries", "HandlerTimeout: slow"),
    ),
    ("retry with a delay", P, Outcome(Cause.HANDLER, 1, Retry(delay=42.0)), nak(42.0)),
    ("retry without one", P, Outcome(Cause.HANDLER, 2, Retry()), nak(5.0)),
    (
        "retry, last",
        P,
        Outcome(Cause.HANDLER, 4, Retry(delay=1.0)),
        dead("max_deliveries", "Retry: retry requested"),
    ),
    ("no client limit", NO_LIMIT, Outcome(Cause.HANDLER, 99, TimeoutError()), nak(None)),
    # the store
    ("store out: disk full", P, Outcome(Cause.STORE, 4, DISK_FULL), IN_PROGRESS),
    ("store locked", P, Outcome(Cause.STORE, 4, LOCKED), nak(STORE_RETRY_DELAY)),
    ("store conflict", P, Outcome(Cause.STORE, 4, CONFLICT), nak(STORE_RETRY_DELAY)),
    ("other workers' conflicts", P, Outcome(Cause.STORE, 4, "conflicts"), nak(STORE_RETRY_DELAY)),
    (
        "data it cannot hold",
        P,
        Outcome(Cause.STORE, 1, NUL),
        dead("unrecoverable", "StoreError: text cannot contain NUL"),
    ),
    ("store corrupt", P, Outcome(Cause.STORE, 2, CORRUPT), nak(5.0)),
    (
        "store corrupt, last",
        P,
        Outcome(Cause.STORE, 4, CORRUPT),
        dead("max_deliveries", "StoreError: database disk image is malformed"),
    ),
    # publishing
    (
        "server away",
        P,
        Outcome(Cause.PUBLISH, 2, PublishError("gone", kind="connection")),
        IN_PROGRESS,
    ),
    (
        "server slow",
        P,
        Outcome(Cause.PUBLISH, 2, PublishError("slow", kind="timeout")),
        IN_PROGRESS,
    ),
    (
        "server store failing",
        P,
        Outcome(Cause.PUBLISH, 2, PublishError("x", kind="store_failed")),
        IN_PROGRESS,
    ),
    (
        "publish refused",
        P,
        Outcome(Cause.PUBLISH, 2, PublishError("no", kind="permission")),
        nak(5.0),
    ),
    ("outputs not published", P, Outcome(Cause.PUBLISH, 4), nak(10.0)),
    (
        "forward failed",
        P,
        Outcome(Cause.FORWARD, 1, PublishError("gone", kind="connection")),
        nak(STORE_RETRY_DELAY),
    ),
    ("dead letter failed", P, Outcome(Cause.DEAD_LETTER, 2, PublishError("x")), nak(5.0)),
    (
        "dead letter failed, no schedule",
        NO_LIMIT,
        Outcome(Cause.DEAD_LETTER, 2),
        nak(DEAD_LETTER_RETRY_DELAY),
    ),
    # admission
    (
        "bad body",
        P,
        Outcome(Cause.REFUSED, error="not JSON", reason="malformed"),
        dead("malformed", "not JSON"),
    ),
    (
        "bad header",
        P,
        Outcome(Cause.REFUSED, error=MalformedMessage("Schema-Version: x"), reason="malformed"),
        dead("malformed", "MalformedMessage: Schema-Version: x"),
    ),
    (
        "another tenant",
        P,
        Outcome(Cause.REFUSED, error="claims t2", reason="rejected"),
        dead("rejected", "claims t2"),
    ),
    (
        "unknown command",
        P,
        Outcome(Cause.REFUSED, error="unknown", reason="unrecoverable"),
        dead("unrecoverable", "unknown"),
    ),
    (
        "too late",
        P,
        Outcome(Cause.REFUSED, error="past its deadline", reason="expired"),
        dead("expired", "past its deadline"),
    ),
    # holds and limits
    ("held", P, Outcome(Cause.HELD, 9, delay=0.7), nak(0.7)),
    ("behind a failure with the backoff", P, Outcome(Cause.HELD, 2), nak(5.0)),
    ("stop not stored", P, Outcome(Cause.STOP_FAILED, 4, DISK_FULL), nak(STORE_RETRY_DELAY)),
    (
        "exhausted",
        P,
        Outcome(Cause.EXHAUSTED, 5),
        dead("max_deliveries", "attempted 5 times; the limit is 4"),
    ),
    (
        "nak on the last delivery",
        P,
        Outcome(Cause.LAST_NAK, 4),
        dead("max_deliveries", "nak on the last delivery"),
    ),
]


@pytest.mark.parametrize(
    ("policy", "outcome", "expected"), [row[1:] for row in TABLE], ids=[row[0] for row in TABLE]
)
def test_the_table(policy: FailurePolicy, outcome: Outcome, expected: Decision) -> None:
    assert policy.decide(outcome) == expected


def test_every_cause_has_a_row() -> None:
    assert {row[2].cause for row in TABLE} == set(Cause)


def test_a_refusal_names_a_reason_of_the_contract() -> None:
    with pytest.raises(ValueError, match="reason must be one of"):
        P.decide(Outcome(Cause.REFUSED, error="x", reason="bored"))


@pytest.mark.parametrize(
    ("attempt", "past"),
    [(1, False), (4, False), (5, True)],
    ids=["first", "last", "after the last"],
)
def test_past_the_limit(attempt: int, past: bool) -> None:
    assert P.past_limit(attempt) is past
    assert not NO_LIMIT.past_limit(attempt)


def test_review_turns_a_nak_the_server_drops_into_a_dead_letter() -> None:
    server = FailurePolicy(max_deliver=3, backoff=BACKOFF, server_max=3)
    assert server.review(Decision.nak(1.0), 2) == nak(1.0)
    assert server.review(Decision.nak(1.0), 3) == dead("max_deliveries", "nak on the last delivery")
    assert server.review(Decision.ack(), 3) == Decision.ack()
    # an engine's durable has no MaxDeliver on the server: its naks always come back
    assert P.review(Decision.nak(1.0), 9) == nak(1.0)


def test_a_stop_follows_every_dead_letter_only_when_asked() -> None:
    stopping = FailurePolicy(max_deliver=4, stop_after_dead_letter=True)
    exhausted = stopping.decide(Outcome(Cause.EXHAUSTED, 5))
    in_transaction = stopping.decide(Outcome(Cause.HANDLER, 1, Unrecoverable("x")))
    assert stopping.stops(exhausted) and stopping.stops(in_transaction)
    assert not stopping.stops(nak(1.0))
    assert not P.stops(exhausted)


def test_backoff_delay_clamps_to_the_schedule() -> None:
    assert backoff_delay(0, BACKOFF) == 1.0
    assert backoff_delay(3, BACKOFF) == 10.0
    assert backoff_delay(30, BACKOFF) == 10.0
    assert backoff_delay(1, ()) is None


# ---------------------------------------------------------------------- properties

_store_errors = st.builds(
    StoreError,
    st.text(max_size=20),
    kind=st.sampled_from(["duplicate", "conflict", "busy", "unavailable", "not_found", "constraint",
                          "invalid", "closed", "error"]),
    retriable=st.booleans(),
)  # fmt: skip
_errors = st.one_of(
    st.builds(RuntimeError, st.text(max_size=20)),
    st.builds(Retry, st.just("later"), delay=st.none() | st.floats(0, 3600)),
    st.sampled_from([MalformedMessage("m"), Unrecoverable("u"), Rejected("r"), Expired("e"),
                     HandlerTimeout("t"), Poison("p"), ValueError("v")]),
    _store_errors,
    st.builds(PublishError, st.just("p"), kind=st.sampled_from(["connection", "timeout", "permission", "error"])),
    st.none(),
)  # fmt: skip
_outcomes = st.builds(
    Outcome,
    st.sampled_from([c for c in Cause if c is not Cause.REFUSED]),
    attempt=st.integers(1, 50),
    error=_errors,
    delay=st.none() | st.floats(0, 60),
)
_policies = st.builds(
    FailurePolicy,
    max_deliver=st.none() | st.integers(1, 20),
    backoff=st.lists(st.floats(0, 600), max_size=6).map(tuple),
    unrecoverable=st.sampled_from([(), (Poison,)]),
    server_max=st.sampled_from([-1, 3, 20]),
    stop_after_dead_letter=st.booleans(),
)


@given(_policies, _outcomes)
def test_properties(policy: FailurePolicy, outcome: Outcome) -> None:
    decision = policy.decide(outcome)
    if decision.action is Action.NAK and decision.delay is not None:
        assert decision.delay >= 0
        retry_asked = outcome.cause is Cause.HANDLER and isinstance(outcome.error, Retry)
        if not retry_asked and outcome.cause is not Cause.HELD:
            # never longer than the schedule's longest entry, or the fixed soon-again delays
            assert decision.delay <= max(
                [*policy.backoff, STORE_RETRY_DELAY, DEAD_LETTER_RETRY_DELAY]
            )
            if outcome.cause in (Cause.HANDLER, Cause.PUBLISH):
                assert decision.delay in policy.backoff
    if decision.action is Action.DEAD_LETTER:
        assert decision.reason in REASONS
        assert decision.error
    # "invalid" is data the store can never hold, whatever retriable says: never transient
    transient = (
        isinstance(outcome.error, StoreError)
        and outcome.error.kind != "invalid"
        and (outcome.error.retriable or outcome.error.kind == "unavailable")
    )
    if outcome.cause is Cause.STORE and transient:
        assert decision.action is not Action.DEAD_LETTER
    if outcome.cause in (Cause.HELD, Cause.FORWARD, Cause.STOP_FAILED, Cause.DEAD_LETTER):
        assert decision.action is Action.NAK  # never an attempt's end


@given(_policies, st.integers(1, 50), st.text(max_size=10), st.sampled_from(REASONS))
def test_a_refusal_keeps_its_reason(
    policy: FailurePolicy, attempt: int, error: str, reason: str
) -> None:
    decision = policy.decide(Outcome(Cause.REFUSED, attempt, error, reason=reason))
    assert (decision.action, decision.reason) == (Action.DEAD_LETTER, reason)
