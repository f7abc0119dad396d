"""The ``meshforge`` command: one program, a sub-command per task.

Each sub-module owns one command (or group) and exposes ``register(app)``.
Exit codes, the same for every command: 0 done; 1 failed (the error is one line on
stderr); 2 usage: a bad argument, option, environment variable or configuration value,
so nothing was done.
"""

from __future__ import annotations

import importlib
import sys
from typing import Annotated

import typer

from meshforge.errors import ConfigError, MeshForgeError

EXIT_FAILED = 1
EXIT_USAGE = 2

app = typer.Typer(
    name="meshforge",
    help="Reliable messaging on NATS JetStream: agents, nodes and a Spark pipeline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode=None,  # usage errors as plain lines, not a box that wraps mid-word
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"meshforge {version('meshforge')}")
        raise typer.Exit(0)


@app.callback()
def _root(
    _show_version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Reliable messaging on NATS JetStream: agents, nodes and a Spark pipeline."""


# Sub-commands, each in its own module with a ``register(app)`` function.
_COMMANDS = (
    "init", "server", "provision", "publish", "events", "run", "relay", "replay", "dlq", "node", "ctl",
    "pipeline", "demo", "permissions", "holds", "console", "schema",
)  # fmt: skip

for _name in _COMMANDS:
    try:
        _module = importlib.import_module(f"meshforge.cli.{_name}")
    except ModuleNotFoundError as _exc:
        if _exc.name != f"meshforge.cli.{_name}":
            raise
        continue
    _module.register(app)


def main() -> None:
    """Console entry point: MeshForge errors become one line and exit 1 (2 for configuration)."""
    try:
        app()
    except MeshForgeError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        sys.exit(EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILED)
