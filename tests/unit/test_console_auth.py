"""The console's tokens, roles and bind rule (no server)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.config import load_settings
from meshforge.console.auth import ConsoleTokens, check_bind, is_loopback
from meshforge.errors import ConfigError


def test_tokens_come_from_settings_or_their_files_and_are_never_shown(tmp_path: Path) -> None:
    secret = tmp_path / "operator.token"
    secret.write_text("op-secret-123\n")
    settings = load_settings(
        env={
            "MESHFORGE_CONSOLE_VIEWER_TOKEN": "view-secret-456",
            "MESHFORGE_CONSOLE_OPERATOR_TOKEN_FILE": str(secret),
        }
    )
    tokens = ConsoleTokens.from_settings(settings)
    assert tokens.role_of("op-secret-123") == "operator"
    assert tokens.role_of("view-secret-456") == "viewer"
    assert tokens.role_of("op-secret-12") is None and tokens.role_of("") is None
    for shown in (repr(settings), repr(tokens)):
        assert "op-secret-123" not in shown and "view-secret-456" not in shown


def test_a_missing_token_file_or_the_same_token_for_both_roles_is_refused(tmp_path: Path) -> None:
    missing = load_settings(env={"MESHFORGE_CONSOLE_VIEWER_TOKEN_FILE": str(tmp_path / "none")})
    with pytest.raises(ConfigError, match="console_viewer_token_file: cannot read"):
        ConsoleTokens.from_settings(missing)
    same = load_settings(
        env={"MESHFORGE_CONSOLE_VIEWER_TOKEN": "x1", "MESHFORGE_CONSOLE_OPERATOR_TOKEN": "x1"}
    )
    with pytest.raises(ConfigError, match="must differ"):
        ConsoleTokens.from_settings(same)


def test_only_loopback_is_served_without_tokens() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.5", "::", "example.com"))
    check_bind("127.0.0.1", ConsoleTokens())
    check_bind("0.0.0.0", ConsoleTokens(operator="t"))
    with pytest.raises(
        ConfigError, match=r"refusing to listen on '0\.0\.0\.0' without authentication"
    ):
        check_bind("0.0.0.0", ConsoleTokens())


def test_the_command_refuses_a_public_host_without_tokens_before_touching_nats() -> None:
    out = CliRunner().invoke(
        app, ["console", "--host", "0.0.0.0", "--nats-url", "nats://127.0.0.1:1"]
    )
    assert out.exit_code != 0
    assert "refusing to listen on '0.0.0.0' without authentication" in str(out.exception)


def test_the_default_port_falls_back_to_a_free_one_and_a_taken_explicit_port_is_an_error() -> None:
    import socket

    from meshforge.cli.console import DEFAULT_PORT, bind

    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", DEFAULT_PORT))
        holder.listen(1)
    except OSError:
        pass  # someone else holds 8222 already: the fallback is needed all the same
    try:
        with bind("127.0.0.1", None) as sock:
            assert sock.getsockname()[1] not in (DEFAULT_PORT, 0)
            taken = sock.getsockname()[1]
            with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{taken}"):
                bind("127.0.0.1", taken)
    finally:
        holder.close()
