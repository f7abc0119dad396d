"""``meshforge console``: the operator's web console, one process, served by uvicorn."""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import Annotated

import typer

from meshforge.cli.common import Agents, NatsUrl, Nodes, load_contract_parts, nats_target

DEFAULT_PORT = 8222


def register(app: typer.Typer) -> None:
    app.command("console")(console)


def bind(host: str, port: int | None) -> socket.socket:
    """A listening socket on ``host``: ``port``, or 8222 when free, else any free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for wanted in [port] if port is not None else [DEFAULT_PORT, 0]:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), wanted))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE and port is None:
                continue
            from meshforge.errors import ConfigError

            raise ConfigError(
                f"console: cannot listen on {host}:{wanted}: {exc.strerror}"
            ) from None
        sock.listen(128)
        sock.set_inheritable(True)
        return sock
    raise AssertionError("unreachable: port 0 always binds")


def console(
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on; beyond loopback needs tokens.")
    ] = "127.0.0.1",
    port: Annotated[
        int | None,
        typer.Option(
            "--port",
            min=0,
            max=65535,
            help="Port (default 8222, or a free one when 8222 is taken; 0: a free one).",
            show_default=False,
        ),
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant",
            envvar="MESHFORGE_TENANT",
            help="Bind the console to one tenant: it sees and acts on that tenant's commands only.",
            show_default=False,
        ),
    ] = None,
    reports: Annotated[
        Path,
        typer.Option("--reports", help="Where `meshforge pipeline audit` writes its reports."),
    ] = Path(".meshforge/pipeline"),
    https_only: Annotated[
        bool,
        typer.Option("--https-only", help="Mark the session cookie Secure (behind a TLS proxy)."),
    ] = False,
    agent: Agents = None,
    node: Nodes = None,
    nats_url: NatsUrl = None,
) -> None:
    """Serve the operator's web console: overview, dead letters, nodes, pipeline reports,
    and the Contract page of the agents (--agent) and node classes (--node) given.

    Tokens: MESHFORGE_CONSOLE_VIEWER_TOKEN and MESHFORGE_CONSOLE_OPERATOR_TOKEN (or their
    _FILE variants). Scripts send `Authorization: Bearer TOKEN`; people sign in once.
    """
    import asyncio

    import uvicorn

    from meshforge.config import load_settings
    from meshforge.console import ConsoleTokens, create_app
    from meshforge.console.auth import check_bind
    from meshforge.ops.observability import configure_logging

    settings = load_settings({"nats_url": nats_url, "tenant": tenant})
    tokens = ConsoleTokens.from_settings(settings)
    check_bind(host, tokens)
    agents, nodes = load_contract_parts(agent, node)
    configure_logging(settings.log_level, settings.log_json)
    with nats_target(settings.nats_url) as url:
        sock = bind(host, port)
        app = create_app(
            settings, nats_url=url, tokens=tokens, reports=reports, https_only=https_only,
            agents=agents, nodes=nodes,
        )  # fmt: skip
        shown = f"[{host.strip('[]')}]" if ":" in host else host
        typer.echo(f"meshforge console at http://{shown}:{sock.getsockname()[1]}/", err=False)
        if not tokens.configured:
            typer.echo("no console token set: open to this machine only, as operator", err=True)
        config = uvicorn.Config(
            app,
            log_config=None,  # uvicorn's lines go through MeshForge's logging, as JSON when asked
            log_level=settings.log_level.lower(),
            proxy_headers=False,  # the client address is the peer's: the audit log names it
            server_header=False,
            access_log=False,
        )
        with sock:
            asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
