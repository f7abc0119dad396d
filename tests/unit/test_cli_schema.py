"""``meshforge schema``: the document on stdout or in a file, payloads alone, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from meshforge.cli import app, main

OFFICIAL = Path(__file__).parent / "asyncapi" / "asyncapi-3.0.0.json"
DEMO = ["meshforge.demo:OrderAgent", "meshforge.demo:InventoryAgent"]


def _accepted(doc: object) -> None:
    schema = json.loads(OFFICIAL.read_text(encoding="utf-8"))
    errors = [e.message[:200] for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    assert errors == []


def test_it_prints_the_asyncapi_document_of_the_agents_and_nodes() -> None:
    done = CliRunner().invoke(
        app, ["schema", *DEMO, "--nodes", "meshforge.demo:DemoNode", "--api-version", "2.1.0"]
    )
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    _accepted(doc)
    assert doc["info"]["version"] == "2.1.0"
    assert "cmd.inventory.reserve" in doc["channels"] and "control.cmd.DemoNode" in doc["channels"]


def test_it_writes_json_or_yaml_to_a_file(tmp_path: Path) -> None:
    for name, load in (("contract.json", json.loads), ("contract.yaml", yaml.safe_load)):
        out = tmp_path / name
        done = CliRunner().invoke(app, ["schema", *DEMO, "--out", str(out), "--title", "Shop"])
        assert done.exit_code == 0 and done.stdout == "", done.output
        doc = load(out.read_text(encoding="utf-8"))
        _accepted(doc)
        assert doc["info"]["title"] == "Shop"


def test_json_schema_format_writes_the_payloads_alone() -> None:
    done = CliRunner().invoke(app, ["schema", DEMO[0], "--format", "json-schema"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    jsonschema.Draft202012Validator.check_schema(doc)
    messages = {name for name in doc["$defs"] if name.startswith(("cmd.", "evt."))}
    assert messages == {
        "cmd.order.create", "cmd.order.get",
        "evt.order.created", "evt.order.not_found", "evt.order.found",
    }  # fmt: skip
    # The demo's declared payload types come along as the definitions the messages name.
    assert {"CreateOrder", "OrderCreated"} <= set(doc["$defs"])
    assert "CreateOrder" in json.dumps(doc["$defs"]["cmd.order.create"])


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["nosuch.module:Agent"], "cannot import 'nosuch.module'"),
        (["meshforge.demo:Nope"], "has no 'Nope'"),
        (["meshforge.demo:DemoNode"], "is not an Agent subclass"),
        (["OrderAgent"], "expected MODULE:AGENT"),
        (["raising_module:Agent"], "cannot load it: RuntimeError: broken at import"),
        ([DEMO[0], "--nodes", DEMO[0]], "expected a meshforge.control.Node"),
        ([], "name at least one"),
        ([DEMO[0], "--out", "/nonexistent/dir/x.json"], "cannot write it"),
    ],
)
def test_a_bad_agent_or_node_is_one_line_and_exit_2(
    args: list[str],
    said: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "raising_module.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the cwd the command adds goes with it
    monkeypatch.setattr(sys, "argv", ["meshforge", "schema", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith("error: ") and said in lines[0], err


def test_the_program_itself_says_it_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshforge", "schema", "meshforge.demo:Nope"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert (
        done.stderr == "error: agent 'meshforge.demo:Nope': module 'meshforge.demo' has no 'Nope'\n"
    )


def test_the_consoles_agent_option_fails_the_same_way_before_it_listens(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["meshforge", "console", "--agent", "meshforge.demo:Nope"])
    with pytest.raises(SystemExit) as exited:
        main()
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and "meshforge console at" not in out
    assert err == "error: agent 'meshforge.demo:Nope': module 'meshforge.demo' has no 'Nope'\n"
