from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshforge.errors import InvalidSubject
from meshforge.topology.subjects import (
    command_subject,
    control_command_subject,
    control_reply_subject,
    dead_letter_subject,
    event_subject,
    find_overlaps,
    matches,
    original_of_dead_letter,
    overlaps,
    validate_subject,
)

ALPHABET = ["a", "b", "c"]
literal_tokens = st.sampled_from(ALPHABET)
pattern_tokens = st.sampled_from([*ALPHABET, "*"])


@st.composite
def patterns(draw: st.DrawFn) -> str:
    toks = draw(st.lists(pattern_tokens, min_size=1, max_size=4))
    if draw(st.booleans()):
        toks.append(">")
    return ".".join(toks)


def all_literals(max_len: int = 6) -> list[str]:
    out: list[list[str]] = [[t] for t in ALPHABET]
    frontier = out
    for _ in range(max_len - 1):
        frontier = [[*s, t] for s in frontier for t in ALPHABET]
        out += frontier
    return [".".join(s) for s in out]


LITERALS = all_literals()


def reference_match(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    if p and p[-1] == ">":
        return len(s) >= len(p) and all(x in ("*", y) for x, y in zip(p[:-1], s, strict=False))
    return len(p) == len(s) and all(x in ("*", y) for x, y in zip(p, s, strict=True))


@settings(max_examples=300)
@given(pattern=patterns(), subject=st.lists(literal_tokens, min_size=1, max_size=6).map(".".join))
def test_matches_agrees_with_reference(pattern: str, subject: str) -> None:
    assert matches(pattern, subject) == reference_match(pattern, subject)


@settings(max_examples=300)
@given(a=patterns(), b=patterns())
def test_overlaps_agrees_with_brute_force(a: str, b: str) -> None:
    # Patterns have at most 5 tokens, so a witness needs at most 6 tokens.
    brute = any(matches(a, s) and matches(b, s) for s in LITERALS)
    assert overlaps(a, b) == brute == overlaps(b, a)


def test_builders() -> None:
    assert command_subject("default", "demo", "order", "create") == "cmd.default.demo.order.create"
    assert event_subject("default", "demo", "order", "created") == "evt.default.demo.order.created"
    assert control_command_subject("lab1", "node7") == "control.cmd.lab1.node7"
    assert control_reply_subject("lab1", "node7") == "control.reply.lab1.node7"
    dl = dead_letter_subject("cmd.default.demo.order.create")
    assert dl == "failed.cmd.default.demo.order.create"
    assert original_of_dead_letter(dl) == "cmd.default.demo.order.create"


@pytest.mark.parametrize(
    "subject",
    ["", "a..b", "a.*", "a.>", "a b", "a.\x01", "a." + "x" * 65, ".".join(["abcdefg"] * 40), "a.é"],
)
def test_bad_subjects_are_refused_naming_them(subject: str) -> None:
    with pytest.raises(InvalidSubject) as info:
        validate_subject(subject)
    assert "\n" not in str(info.value)


def test_wildcards_allowed_in_patterns_only() -> None:
    assert validate_subject("cmd.*.*.order.>", wildcards=True)
    with pytest.raises(InvalidSubject, match="last token"):
        validate_subject("a.>.b", wildcards=True)
    with pytest.raises(InvalidSubject, match="tenant"):
        command_subject("bad tenant", "demo", "order", "create")


def test_find_overlaps() -> None:
    assert find_overlaps(["cmd.>"], ["evt.>", "cmd.a.b"]) == [("cmd.>", "cmd.a.b")]
