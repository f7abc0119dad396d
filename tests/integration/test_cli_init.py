"""``meshforge init``: a new project whose own tests pass at once; ``--from`` a spec; refusals."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from meshforge.config import load_settings

SRC = Path(__file__).resolve().parents[2] / "src"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHFORGE_", "PYTEST_"))}
    env["PYTHONPATH"] = str(SRC)
    return env


def meshforge(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshforge", *args], cwd=cwd, env=_env(),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def project_tests(project: Path) -> subprocess.CompletedProcess[str]:
    # -p names the plugin also when this environment's entry points predate it.
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "meshforge.testing.plugin", "-p", "no:cacheprovider"],
        cwd=project, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_init_writes_a_project_whose_own_tests_pass(tmp_path: Path) -> None:
    done = meshforge(tmp_path, "init", "shop")
    assert done.returncode == 0, done.stderr
    project = tmp_path / "shop"
    names = {str(p.relative_to(project)) for p in project.rglob("*") if p.is_file()}
    assert {"README.md", "meshforge.toml", "compose.yaml", "Makefile", "pyproject.toml",
            "shop/order.py", "tests/test_order.py"} <= names  # fmt: skip
    makefile = (project / "Makefile").read_text()
    assert "\nrun:\n\t$(PYTHON) -m meshforge run $(AGENTS)" in makefile and "\ntest:\n" in makefile
    assert "AGENTS := shop.order:OrderAgent" in makefile
    compose = yaml.safe_load((project / "compose.yaml").read_text())
    assert "-js" in compose["services"]["nats"]["command"] and "postgres" not in compose["services"]
    settings = load_settings(env={}, config_file=project / "meshforge.toml")
    assert settings.store_url == "sqlite:///.meshforge/store.db" and settings.nats_url is None
    tests = project_tests(project)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    # The command, its missing key, a field of the wrong type, and the live worker.
    assert "4 passed" in tests.stdout


SPEC = {
    "agents": [
        {"name": "order", "commands": [
            {"name": "create", "fields": {"sku": "str", "qty": "int", "tags": "list[str] | None"},
             "events": ["created"]},
            {"name": "cancel", "events": ["cancel_requested", "cancelled"]},
        ]},
        {"name": "payment", "key": "payment_ref", "commands": [
            {"name": "capture", "fields": {"payment_ref": "int", "amount": "float", "card": "bool"},
             "events": ["captured"]},
        ]},
    ]
}  # fmt: skip


def test_init_from_a_spec_generates_its_agents_commands_and_events(tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC, sort_keys=False))
    done = meshforge(tmp_path, "init", "my-shop", "--from", "spec.yaml", "--store", "postgres",
                     "--profile", "compose")  # fmt: skip
    assert done.returncode == 0, done.stderr
    project = tmp_path / "my-shop"
    order = (project / "my_shop" / "order.py").read_text()
    assert '@command("cancel", key="order_id")' in order and 'Event("cancelled"' in order
    # Typed payloads: a Struct per command and per event, from the spec's fields.
    assert (
        "class CreateOrder(msgspec.Struct, frozen=True, kw_only=True):\n"
        '    """The payload of ``order.create``."""\n\n'
        "    order_id: str\n    sku: str\n    qty: int\n    tags: list[str] | None = None\n"
    ) in order
    assert "def create(self, cmd: Command[CreateOrder], state: OrderState)" in order
    assert "class OrderCancelRequested(msgspec.Struct, frozen=True, kw_only=True):" in order
    assert 'Event("cancelled", OrderCancelled(order_id=p.order_id)),' in order
    payment = (project / "my_shop" / "payment.py").read_text()
    assert '@command("capture", key="payment_ref")' in payment
    assert "    payment_ref: int\n    amount: float\n    card: bool\n" in payment
    compose = yaml.safe_load((project / "compose.yaml").read_text())
    assert compose["services"]["postgres"]["environment"]["POSTGRES_DB"] == "my_shop"
    settings = load_settings(env={}, config_file=project / "meshforge.toml")
    assert (
        settings.store_url.startswith("postgresql://")
        and settings.nats_url == "nats://127.0.0.1:4222"
    )
    assert tomllib.loads((project / "pyproject.toml").read_text())["project"]["dependencies"] == [
        "meshforge[postgres]>=0.1"
    ]
    tests = project_tests(project)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    # Per agent: one test per command, the missing key, a wrong type, and the live worker.
    assert "9 passed" in tests.stdout


def test_init_refuses_a_directory_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "shop").mkdir()
    (tmp_path / "shop" / "notes.txt").write_text("mine")
    done = meshforge(tmp_path, "init", "shop")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: shop exists and is not empty; choose another NAME or empty it"
    ]
    assert [p.name for p in (tmp_path / "shop").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("agents: []\n", "spec.yaml: agents: expected a non-empty list, got an empty list"),
        ("agents:\n  - name: Order\n    commands: [{name: create, events: [created]}]\n",
         "spec.yaml: agents[0].name: expected a lower-case name (a-z, 0-9, _; starting with a letter), got 'Order'"),
        ("agents:\n  - name: order\n    commands: [{name: create}]\n",
         "spec.yaml: agents[0].commands[0]: missing 'events'"),
        ("agents:\n  - name: order\n    comands: []\n",
         "spec.yaml: agents[0]: unknown field 'comands'; known: commands, key, name"),
        ("agents:\n  - name: order\n    commands: [{name: apply, events: [x]}]\n",
         "spec.yaml: agents[0].commands[0].name: 'apply' is reserved by Agent; choose another command name"),
        ("agents:\n  - name: a\n    commands: [{name: c, events: [e, e]}]\n",
         "spec.yaml: agents[0].commands[0].events: event 'e' appears twice"),
        ("agents: [name: x\n", "spec.yaml: invalid YAML at line 2: expected ',' or ']', but got '<stream end>'"),
        ("agents:\n  - name: a\n    commands: [{name: c, events: [e], fields: {qty: integer}}]\n",
         "spec.yaml: agents[0].commands[0].fields.qty: expected str, int, float, bool or list[...] of one, optionally '| None', got 'integer'"),
        ("agents:\n  - name: a\n    commands: [{name: c, events: [e], fields: [qty]}]\n",
         "spec.yaml: agents[0].commands[0].fields: expected a mapping of field name to type, got list ['qty']"),
        ("agents:\n  - name: a\n    commands: [{name: c, events: [e], fields: {a_id: float}}]\n",
         "spec.yaml: agents[0].commands[0].fields.a_id: the key 'a_id' must be str or int, got 'float'"),
        ("agents:\n  - name: a\n    commands: [{name: c, events: [e], fields: {n: int}}, {name: d, events: [e]}]\n",
         "spec.yaml: agents[0]: event 'e' comes from commands 'c' and 'd' with different fields; give them the same fields or name the events apart"),
        ("agents:\n  - name: a\n    commands: [{name: c, events: [state]}]\n",
         "spec.yaml: agents[0]: generated classes: class 'AState' appears twice"),
    ],
)  # fmt: skip
def test_init_from_a_bad_spec_says_where_in_one_line_and_writes_nothing(
    tmp_path: Path, spec: str, message: str
) -> None:
    (tmp_path / "spec.yaml").write_text(spec)
    done = meshforge(tmp_path, "init", "shop", "--from", "spec.yaml")
    assert done.returncode == 2  # usage: a bad input, nothing done
    assert done.stderr.strip().splitlines() == [f"error: {message}"]
    assert not (tmp_path / "shop").exists()


def test_init_refuses_a_name_that_would_shadow_a_module(tmp_path: Path) -> None:
    done = meshforge(tmp_path, "init", "json")
    assert done.returncode == 2
    assert "its package 'json' would shadow a module" in done.stderr
    assert not (tmp_path / "json").exists()
