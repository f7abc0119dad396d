"""The demo agents exactly as CONTRACT.md describes them, and `meshforge run` / `meshforge replay`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_engine_support import EventWatchFor, open_conn, running, settings_for
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.cli.demo_support import AgentProcess, meshforge_command
from meshforge.demo import InventoryAgent, OrderAgent
from meshforge.envelope import Envelope, derive_id
from meshforge.errors import ConfigError
from meshforge.publish.publisher import Publisher
from meshforge.runtime.agent import derive_uuid
from meshforge.runtime.worker import import_from_cwd, load_agent
from meshforge.transport.server import EmbeddedServer


async def test_demo_agents_follow_the_contract(
    private_server: EmbeddedServer, sqlite_url: str
) -> None:
    settings = settings_for(private_server.url, sqlite_url)
    conn = await open_conn(settings)
    watch = await EventWatchFor.start(conn, "evt.>")
    publisher = Publisher(conn.js)

    async def ask(command: str, payload: dict[str, Any], **fields: Any) -> Envelope:
        env = Envelope.new(command, payload, source="test", **fields)
        await publisher.publish(f"cmd.default.demo.{command}", env)
        return env

    try:
        async with running([OrderAgent(), InventoryAgent()], settings):
            stock = await ask("inventory.create", {"sku": "S1", "qty": 5})
            created_stock = await watch.caused_by(stock)
            assert (created_stock.type, created_stock.subject) == (
                "inventory.created",
                "evt.default.demo.inventory.created",
            )

            given = await ask("order.create", {"order_id": "o-1", "sku": "S1", "qty": 3})
            order = await watch.caused_by(given)
            assert order.type == "order.created" and order.payload == {
                "order_id": "o-1",
                "sku": "S1",
                "qty": 3,
            }
            assert order.subject == "evt.default.demo.order.created"
            reserved = await watch.caused_by_id(_reserve_id(given))
            assert reserved.type == "inventory.reserved" and reserved.payload["order_id"] == "o-1"

            anonymous = await ask("order.create", {"sku": "S1", "qty": 3}, idempotency_key="req-42")
            second = await watch.caused_by(anonymous)
            assert second.payload["order_id"] == derive_uuid("order", "req-42")
            rejected = await watch.caused_by_id(_reserve_id(anonymous))
            assert (
                rejected.type == "inventory.rejected"
                and rejected.payload["reason"] == "not enough stock"
            )

            found = await watch.caused_by(await ask("order.get", {"order_id": "o-1"}))
            assert found.type == "order.found"
            assert found.payload["order"] == {
                "order_id": "o-1",
                "sku": "S1",
                "qty": 3,
                "status": "created",
            }
            missing = await watch.caused_by(await ask("order.get", {"order_id": "nope"}))
            assert (missing.type, missing.payload) == ("order.not_found", {"order_id": "nope"})

            level = await watch.caused_by(await ask("inventory.get", {"sku": "S1"}))
            assert (level.type, level.payload) == (
                "inventory.found",
                {"sku": "S1", "qty": 5, "reserved": 3},
            )
            none = await watch.caused_by(await ask("inventory.get", {"sku": "S9"}))
            assert none.type == "inventory.not_found"

            # The same request again (new message, same Idempotency-Key): same event, no change.
            mark = len(watch.seen)
            again = await ask("order.create", {"sku": "S1", "qty": 3}, idempotency_key="req-42")
            echo = await watch.first(
                lambda e: e.type == "order.created" and e.id == second.id, after=mark
            )
            assert echo.causation_id == anonymous.id  # the stored event, as first published
            level = await watch.caused_by(await ask("inventory.get", {"sku": "S1"}))
            assert level.payload["reserved"] == 3
            assert again.id != anonymous.id
    finally:
        await watch.stop()
        await conn.close()


ROOT = Path(__file__).resolve().parents[2]


def _reserve_id(create: Envelope) -> str:
    return derive_id(create.id, 1)  # the order's second output: its inventory.reserve


async def test_meshforge_run_and_replay_from_the_command_line(
    private_server: EmbeddedServer, tmp_path: Path
) -> None:
    store = f"sqlite:///{tmp_path / 'orders.db'}"
    proc = AgentProcess(
        "meshforge.demo:OrderAgent", store, private_server.url, tmp_path / "run.log"
    )
    settings = settings_for(private_server.url, store)
    conn = await open_conn(settings)
    watch = await EventWatchFor.start(conn, "evt.default.demo.order.>")
    try:
        proc.start()
        publisher = Publisher(conn.js)
        envs = [Envelope.new("order.create", {"sku": "S", "qty": i + 1}) for i in range(5)]
        for env in envs:
            await publisher.publish("cmd.default.demo.order.create", env)
        for env in envs:
            await watch.caused_by(env, within=30)
        assert proc.stop(15) == 0  # SIGTERM: graceful, exit 0
    finally:
        proc.kill()
        await watch.stop()
        await conn.close()

    result = CliRunner().invoke(app, ["replay", "order", "--store", store])
    assert result.exit_code == 0, result.output
    assert "agent order: 5 events over 5 resources" in result.output
    assert "state hash: sha256:" in result.output
    result = CliRunner().invoke(
        app, ["replay", "meshforge.demo:OrderAgent", "--store", store, "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["events"] == 5 and report["mismatched"] == []
    assert report["snapshot_hash"] == report["stored_hash"]

    # A misspelt agent, tenant or store is an error naming what there is; nothing is created.
    misspelt = CliRunner().invoke(app, ["replay", "ordr", "--store", store])
    assert isinstance(misspelt.exception, ConfigError) and "agents with events: order" in str(
        misspelt.exception
    )
    elsewhere = CliRunner().invoke(app, ["replay", "order", "--store", store, "--tenant", "acme"])
    assert isinstance(elsewhere.exception, ConfigError) and "default/demo" in str(
        elsewhere.exception
    )
    missing = tmp_path / "nowhere" / "store.db"
    absent = CliRunner().invoke(app, ["replay", "order", "--store", f"sqlite:///{missing}"])
    assert isinstance(absent.exception, ConfigError) and str(missing) in str(absent.exception)
    assert not missing.parent.exists()


def test_meshforge_run_refuses_a_bad_agent_in_one_line(tmp_path: Path) -> None:
    for spec, words in (("nomodule", "expected MODULE:AGENT"), ("meshforge.demo:Nope", "has no 'Nope'"),
                        ("json:dumps", "not an Agent")):  # fmt: skip
        out = subprocess.run(
            meshforge_command("run", spec, "--nats-url", "nats://127.0.0.1:1"),
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert out.returncode == 2  # a bad argument is a usage error
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], out.stderr


async def test_the_twenty_line_example_runs(
    private_server: EmbeddedServer, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    import_from_cwd()
    example = load_agent("examples.order_agent:Orders")
    settings = settings_for(private_server.url, sqlite_url)
    conn = await open_conn(settings)
    watch = await EventWatchFor.start(conn, "evt.>")
    try:
        async with running([example, InventoryAgent()], settings):
            publisher = Publisher(conn.js)
            stock = Envelope.new("inventory.create", {"sku": "K", "qty": 9})
            await publisher.publish("cmd.default.demo.inventory.create", stock)
            await watch.caused_by(stock)
            place = Envelope.new("shop.place", {"order_id": "p1", "sku": "K", "qty": 4})
            await publisher.publish("cmd.default.demo.shop.place", place)
            placed = await watch.caused_by(place)
            assert placed.subject == "evt.default.demo.shop.placed"
            reserved = await watch.caused_by_id(derive_id(place.id, 1))
            assert reserved.type == "inventory.reserved"
    finally:
        await watch.stop()
        await conn.close()


@pytest.mark.slow
def test_meshforge_demo_tells_the_whole_story(tmp_path: Path) -> None:
    out = subprocess.run(
        meshforge_command("demo", "--orders", "300", "--timeout", "120"),
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "COLUMNS": "120", "MESHFORGE_HOME": str(tmp_path / ".meshforge")},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for step in ("Step 1: Create Order", "Step 2: Verify State", "Step 3: Idempotency Test",
                 "Step 4: Inventory Interaction", "SMOKE TEST PASSED", "killed with SIGKILL"):  # fmt: skip
        assert step in text, text
    assert "Idempotency: Event re-received with the same id" in text
    assert "nothing lost, nothing doubled" in text
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in text.splitlines() if line.count("│") == 3}  # fmt: skip
    assert rows["commands sent"] == "300" and rows["orders created"] == "300"
    assert rows["duplicate effects"] == "0" and rows["lost commands"] == "0"
    assert rows["order snapshot hash, replayed"].endswith("✅")
    assert (tmp_path / ".meshforge" / "demo" / "store.db").exists()
    # The story ends with the Spark ingest and audit over this run's events.
    assert "audit: exactly-once holds over what landed" in text, text[-3000:]
    assert rows["duplicate effects"] == "0"
    report = tmp_path / ".meshforge" / "demo" / "pipeline" / "report" / "audit.html"
    assert report.exists() and "audit.html" in text


def test_no_provision_fails_clearly_when_topology_is_missing(
    private_server: EmbeddedServer, tmp_path: Path
) -> None:
    out = subprocess.run(
        meshforge_command("run", "meshforge.demo:OrderAgent", "--no-provision", "--nats-url",
                          private_server.url, "--store", f"sqlite:///{tmp_path / 's.db'}"),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "missing JetStream topology" in errors[0], out.stderr
    assert "MESHFORGE_COMMANDS" in errors[0]


def test_no_provision_names_the_command_that_creates_what_is_missing(
    private_server: EmbeddedServer, tmp_path: Path
) -> None:
    """The hint, run as written, creates the tenant-bound consumer the worker needs."""
    env = {**os.environ, "MESHFORGE_TENANT": "acme"}
    store = ["--store", f"sqlite:///{tmp_path / 's.db'}"]
    url = ["--nats-url", private_server.url]
    out = subprocess.run(
        meshforge_command("run", "meshforge.demo:OrderAgent", "--no-provision", *url, *store),
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    hint = out.stderr.split("run `", 1)[1].split("`", 1)[0]
    assert hint == "meshforge provision --agent order --tenant acme", out.stderr
    fixed = subprocess.run(
        meshforge_command(*hint.split()[1:], *url), capture_output=True, text=True, timeout=60, check=False
    )  # fmt: skip
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "order_consumer_acme_all" in fixed.stdout
