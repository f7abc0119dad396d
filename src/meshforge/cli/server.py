"""``meshforge server``: run the embedded NATS server, or a local cluster, in the foreground.

Each data directory is locked while served: a second ``meshforge server`` on the same
``MESHFORGE_HOME`` stops at once with one line naming the running server.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from meshforge.cli.common import HOME, announced, embedded_server, serving_home

if TYPE_CHECKING:
    from meshforge.cluster import EmbeddedCluster


def register(app: typer.Typer) -> None:
    app.command("server")(server)


def _stop_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))


def server(
    port: Annotated[
        int | None,
        typer.Option(
            help="Client port (with --cluster: the first node's, the others follow); "
            "a free one when not given."
        ),
    ] = None,
    cluster: Annotated[
        int | None,
        typer.Option(
            "--cluster",
            metavar="N",
            min=3,
            max=5,
            help="Run a local cluster of N JetStream servers (3 to 5) routed on loopback, "
            "data under ./.meshforge/cluster/.",
        ),
    ] = None,
) -> None:
    """Run the embedded nats-server (JetStream on, data under ./.meshforge/) until Ctrl-C.

    With --cluster N, run N servers routed on loopback instead, each with its own data
    directory, and print their client URLs once JetStream has a meta leader.
    """
    HOME.mkdir(parents=True, exist_ok=True)
    if cluster:
        _serve_cluster(cluster, port)
        return
    with embedded_server(HOME, port=port) as srv:
        typer.echo(f"nats-server listening on {srv.url} (data in {srv.store_dir})")
        typer.echo(f"use it with: export MESHFORGE_NATS_URL={srv.url}")
        _stop_on_sigterm()
        try:
            srv.wait()
        except KeyboardInterrupt:
            typer.echo("stopping nats-server")


def _serve_cluster(size: int, port: int | None) -> None:
    from meshforge.cluster import EmbeddedCluster

    data_dir = HOME / "cluster"
    with (
        serving_home(HOME) as lock,
        EmbeddedCluster(size, data_dir=data_dir, port=port) as nodes,
        announced(lock, os.getpid(), nodes.url),
    ):
        _report_and_wait(nodes, size, data_dir)


def _report_and_wait(nodes: EmbeddedCluster, size: int, data_dir: Path) -> None:
    """Print the nodes and client URLs, then run until a signal or a node's exit."""
    typer.echo(
        f"nats-server cluster {nodes.name!r} of {size} nodes on loopback, JetStream meta "
        f"leader {nodes.meta_leader()} (data in {data_dir})"
    )
    for name, node in zip(nodes.names, nodes.nodes, strict=True):
        typer.echo(f"  {name}: {node.url}")
    typer.echo(f"use it with: export MESHFORGE_NATS_URL={nodes.url}")
    typer.echo(f"replicate with: export MESHFORGE_REPLICAS={min(size, 3)}; meshforge provision")
    _stop_on_sigterm()
    try:
        name, code = nodes.wait()
    except KeyboardInterrupt:
        typer.echo("stopping the cluster")
        return
    typer.secho(
        f"error: node {name} exited with code {code}; stopping the cluster",
        err=True,
        fg=typer.colors.RED,
    )
    raise typer.Exit(1)
