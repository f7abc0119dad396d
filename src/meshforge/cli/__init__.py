"""The ``meshforge`` command: one program, a sub-command per task.

Each sub-module owns one command (or group) and exposes ``register(app)``.
Errors of the ``MeshForgeError`` family end the program with one line and exit 1.
"""

from __future__ import annotations

import importlib
import sys

import typer

from meshforge.errors import MeshForgeError

app = typer.Typer(
    name="meshforge",
    help="Reliable messaging on NATS JetStream: agents, nodes and a Spark pipeline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def _root() -> None:
    """Reliable messaging on NATS JetStream: agents, nodes and a Spark pipeline."""


# Sub-commands, each in its own module with a ``register(app)`` function.
_COMMANDS = (
    "init", "server", "provision", "publish", "run", "relay", "replay", "dlq", "node", "ctl",
    "pipeline", "demo",
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
    """Console entry point: run the app, turning MeshForge errors into one line and exit 1."""
    try:
        app()
    except MeshForgeError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        sys.exit(1)
