"""The package's shape: its public names stay, its layers hold, few modules sit at its root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import meshforge

ROOT = Path(__file__).resolve().parents[2]

# Every name ``meshforge.X`` offers; a name that disappears breaks users' code.
PUBLIC = {
    "Action", "Agent", "Command", "ConfigError", "Connection", "Consumer", "ControlClient", "DeadLetters",
    "Decision", "Delivery", "EmbeddedServer", "Engine", "Envelope", "Event", "Expired",
    "InvalidPayload", "MalformedMessage", "MeshForgeError", "Metrics", "Node", "NodeRuntime", "Outbound",
    "OutboxRelay", "PublishError", "PublishResult", "Publisher", "Rejected", "Retry", "Scope",
    "Send", "Settings", "SyncPublisher", "Unrecoverable", "agent_consumer", "command", "connect",
    "dead_letter", "decode", "default_streams", "ensure", "load_settings", "node_consumer",
    "open_store", "replay", "verify", "with_inbox",
}  # fmt: skip

# The modules that may sit at the package root; everything else lives in a folder.
AT_ROOT = {"__init__.py", "__main__.py", "envelope.py", "errors.py"}


def test_every_public_name_is_still_offered_and_resolves() -> None:
    assert set(meshforge.__all__) == PUBLIC
    for name in sorted(PUBLIC):
        assert getattr(meshforge, name) is not None, name


def test_only_a_handful_of_modules_sit_at_the_package_root() -> None:
    root = Path(meshforge.__file__).parent
    assert {p.name for p in root.glob("*.py")} == AT_ROOT


def test_the_import_contract_of_pyproject_holds() -> None:
    """Layers never reach back and no folder imports its way back to itself (import-linter)."""
    done = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
         "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
