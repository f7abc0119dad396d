"""The reply-inbox prefix against a real server: a user not allowed its own inbox fails at
connect in one line naming what to grant; `--inbox-prefix` and MESHFORGE_INBOX_PREFIX agree."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from auth_support import configured_server
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.cli.demo_support import meshforge_command
from meshforge.config import load_settings
from meshforge.errors import ConnectionFailed
from meshforge.spark.nats_sync import ConnOptions, SyncNats
from meshforge.transport.connection import connect

OLD_STYLE = """
authorization { users = [
  {user: alice, password: pw, permissions: {publish: {allow: [">"]}, subscribe: {allow: ["_INBOX.>"]}}}
] }
"""


async def test_a_user_granted_only_the_shared_inbox_is_told_what_to_grant(tmp_path: Path) -> None:
    with configured_server(tmp_path, OLD_STYLE) as server:
        s = load_settings({"user": "alice", "password": "pw", "connect_attempts": 3}, env={})
        with pytest.raises(ConnectionFailed) as info:
            await connect(s, url=server.url)
        message = str(info.value)
        assert "\n" not in message and "after 1 attempt(s)" in message, message
        assert (
            "allow _INBOX_alice.> (`meshforge permissions` prints it) or set MESHFORGE_INBOX_PREFIX"
            in message
        )
        options = {"servers": server.url, "user": "alice", "password": "pw"}
        with pytest.raises(ConnectionFailed, match=re.escape("reply inbox _INBOX_alice.>")):
            SyncNats(ConnOptions.from_options(options))
        # The prefix the server allows, set by hand: it connects and gets its replies.
        legacy = load_settings(
            {"user": "alice", "password": "pw", "inbox_prefix": "_INBOX"}, env={}
        )
        async with await connect(legacy, url=server.url) as conn:
            assert "error" not in (await conn.health())["jetstream"]


def test_the_cli_uses_the_prefix_the_printed_block_grants(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = (
        CliRunner()
        .invoke(
            app, ["permissions", "admin", "--user", "deploy", "--inbox-prefix", "_INBOX_ops.deploy"]
        )
        .output
    )
    assert '"_INBOX_ops.deploy.>"' in block
    monkeypatch.setenv("DEPLOY_PASSWORD", "pw-deploy")
    with configured_server(tmp_path, block) as server:
        base = {
            "MESHFORGE_USER": "deploy",
            "MESHFORGE_PASSWORD": "pw-deploy",
            "PATH": "/usr/bin:/bin",
        }

        def provision(**env: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                meshforge_command("provision", "--nats-url", server.url), capture_output=True, text=True,
                timeout=60, env={**_python_env(), **base, **env},
            )  # fmt: skip

        wrong = provision()  # the prefix from the user name: not what was granted
        assert wrong.returncode == 1 and "reply inbox _INBOX_deploy.>" in wrong.stderr, wrong.stderr
        done = provision(MESHFORGE_INBOX_PREFIX="_INBOX_ops.deploy")
        assert done.returncode == 0, done.stderr


def _python_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_")}
