"""``meshforge server``: run the embedded NATS server in the foreground."""

from __future__ import annotations

import signal
from typing import Annotated

import typer

from meshforge.cli.common import HOME, embedded_server


def register(app: typer.Typer) -> None:
    app.command("server")(server)


def server(
    port: Annotated[int | None, typer.Option(help="Client port; a free one when not given.")] = None,
) -> None:
    """Run the embedded nats-server (JetStream on, data under ./.meshforge/) until Ctrl-C."""
    HOME.mkdir(parents=True, exist_ok=True)
    with embedded_server(HOME, port=port) as srv:
        typer.echo(f"nats-server listening on {srv.url} (data in {srv.store_dir})")
        typer.echo(f"use it with: export MESHFORGE_NATS_URL={srv.url}")
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        try:
            srv.wait()
        except KeyboardInterrupt:
            typer.echo("stopping nats-server")
