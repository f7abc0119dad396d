"""`run --log-level info` says what was handled: one summary line a second at most, never one per command."""

from __future__ import annotations

import itertools
import logging
import re
import time

import pytest
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.demo import InventoryAgent
from meshforge.errors import ConfigError
from meshforge.runtime.activity import describe
from polling import wait_until


async def test_a_busy_worker_logs_a_rate_summary_not_a_line_per_command(
    agent_worker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="meshforge.activity")
    started = time.monotonic()
    async with agent_worker(InventoryAgent()) as h:
        for n in range(300):
            await h.send("inventory", "create", {"sku": f"s-{n}", "qty": 1})
        await h.send("inventory", "create", {"sku": "dup", "qty": 1}, idempotency_key="k-1")
        await h.send("inventory", "create", {"sku": "dup", "qty": 1}, idempotency_key="k-1")
        for n in range(3):
            await h.send("inventory", "create", {"sku": f"bad-{n}", "qty": 0})

        def counted() -> dict[str, int]:
            seen = {"ok": 0, "duplicate": 0, "dead": 0}
            for record in caplog.records:
                if record.name != "meshforge.activity":
                    continue
                for number, what in re.findall(
                    r"(\d+) (ok|duplicate|dead-lettered)", record.getMessage()
                ):
                    seen[what.split("-")[0]] += int(number)
            return seen

        def added_up() -> bool:
            # A redelivery (the test's first ack wait is 50 ms: a loaded machine can miss
            # it) is one more duplicate, never one more ok.
            seen = counted()
            return seen["ok"] == 301 and seen["dead"] == 3 and seen["duplicate"] >= 1

        await wait_until(added_up, timeout=30, what="summaries adding up")
        assert counted()["ok"] == 301, counted()
    elapsed = time.monotonic() - started
    lines = [r for r in caplog.records if r.name == "meshforge.activity"]
    assert 1 <= len(lines) <= elapsed + 1
    assert all(b.created - a.created >= 0.9 for a, b in itertools.pairwise(lines))
    text = " ".join(r.getMessage() for r in lines)
    assert re.search(r"handled \d+ command\(s\) in \d+\.\ds \(\d+/s\): inventory ", text), text
    assert "invalid_payload)" in text and re.search(r"\d+ duplicate", text), text


def test_the_summary_says_what_changed_and_nothing_when_nothing_did() -> None:
    before = {
        "order_consumer": {"acked": 10.0, "duplicate": 1.0, "retried": 0.0, "dead:malformed": 2.0}
    }
    after = {
        "order_consumer": {"acked": 15.0, "duplicate": 2.0, "retried": 1.0, "dead:malformed": 3.0}
    }
    line = describe(before, after, 1.0, {"order_consumer": "order"})
    assert (
        line
        == "handled 5 command(s) in 1.0s (5/s): order 3 ok, 1 duplicate, 1 to retry, 1 dead-lettered (1 malformed)"
    )
    assert describe(after, after, 1.0, {}) is None


def test_run_refuses_an_unknown_log_level() -> None:
    out = CliRunner().invoke(app, ["run", "meshforge.demo:OrderAgent", "--log-level", "chatty"])
    assert isinstance(out.exception, ConfigError)  # main() makes it exit 2 with one line
    assert "expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'chatty'" in str(
        out.exception
    )
