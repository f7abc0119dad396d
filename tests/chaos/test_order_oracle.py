"""The order checker's oracle on planted runs: it passes a right one and names each fault."""

from __future__ import annotations

from order_oracle import Command, WireEvent, check

CMDS = [
    Command("a1", "A", 1, 10), Command("b1", "B", 1, 11), Command("a2", "A", 2, 12, "fatal", fatal=True),
    Command("a3", "A", 3, 13, "fail=1"), Command("b2", "B", 2, 14),
]  # fmt: skip


def wire(*items: tuple[str, int, int]) -> list[WireEvent]:
    """Events as (command id, n, at), stored in the order given."""
    return [WireEvent(f"e-{cid}", cid, n, at, 100 + i) for i, (cid, n, at) in enumerate(items)]


RIGHT = {
    "dead_letters": ["a2"],
    "states": {"A": [1, 3], "B": [1, 2]},
    "log": {"A": [1, 3], "B": [1, 2]},
    "wire": wire(("a1", 1, 0), ("b1", 1, 0), ("b2", 2, 1), ("a3", 3, 1)),
}


def test_a_right_run_passes_even_with_events_republished_out_of_wire_order() -> None:
    outcome = check(CMDS, **RIGHT)  # type: ignore[arg-type]
    assert outcome.ok, outcome.violations
    assert (outcome.applied, outcome.dead_lettered) == (4, 1)
    late = check(
        CMDS, **{**RIGHT, "wire": wire(("a3", 3, 1), ("b1", 1, 0), ("b2", 2, 1), ("a1", 1, 0))}
    )  # type: ignore[arg-type]
    assert late.ok and late.inversions == 1


def test_a_held_back_command_applied_after_later_ones_is_named_with_its_resource() -> None:
    # The case: n=1 failed once, the next fetch applied the later ones first.
    swapped = {"states": {**RIGHT["states"], "A": [3, 1]}, "log": {**RIGHT["log"], "A": [3, 1]},  # type: ignore[dict-item]
               "wire": wire(("a3", 3, 0), ("a1", 1, 1), ("b1", 1, 0), ("b2", 2, 1))}  # fmt: skip
    outcome = check(CMDS, **{**RIGHT, **swapped})  # type: ignore[arg-type]
    [violation] = outcome.violations
    assert violation.startswith("resource A: applied out of order")
    assert (
        "must be applied:       [1, 3]" in violation
        and "store state:           [3, 1]" in violation
    )
    assert "n=2@12[fatal] DEAD" in violation and "events stream by 'at': [3, 1]" in violation


def test_an_event_stored_twice_is_counted_not_merged_as_a_set() -> None:
    doubled = [*RIGHT["wire"], WireEvent("e-b2", "b2", 2, 1, 200)]  # type: ignore[list-item]
    outcome = check(CMDS, **{**RIGHT, "wire": doubled})  # type: ignore[arg-type]
    assert outcome.violations == [
        "event e-b2 of B n=2 (seq 14, id b2) is stored 2 times in the events stream"
    ]


def test_lost_doubled_and_wrongly_dead_lettered_commands_are_named() -> None:
    outcome = check(
        CMDS, dead_letters=["a2", "b1"], states={"A": [1, 3, 3], "B": [2]}, log={"A": [1, 3, 3], "B": [2]},
        wire=[*wire(("a1", 1, 0), ("a3", 3, 1), ("b2", 2, 0)), WireEvent("x", "a3", 3, 2, 300)], left=1,
    )  # fmt: skip
    said = "\n".join(outcome.violations)
    assert "1 command(s) never left the commands stream" in said
    assert (
        "B n=1 (seq 11, id b1) was dead-lettered though only transient faults were planned" in said
    )
    assert "A n=3 (seq 13, id a3) has 2 distinct events (want 1)" in said
    assert "store state:           [1, 3, 3]" in said
    missing = check(CMDS, **{**RIGHT, "dead_letters": []})  # type: ignore[arg-type]
    assert any(
        "planned to fail for good but was not dead-lettered" in v for v in missing.violations
    )
