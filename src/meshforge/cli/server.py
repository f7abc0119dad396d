"""``meshforge server``: run the embedded NATS server, or a local cluster, in the foreground.

Each data directory is locked while served: a second ``meshforge server`` on the same
``MESHFORGE_HOME`` stops at once with one line naming the running server.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from meshforge.cli.common import HOME, announced, embedded_server, serving_home

if TYPE_CHECKING:
    from meshforge.transport.cluster import EmbeddedCluster
    from meshforge.transport.server import EmbeddedServer


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
            "data under ./.meshforge/transport/cluster/.",
        ),
    ] = None,
    leaf: Annotated[
        str | None,
        typer.Option(
            "--leaf",
            metavar="HUB_URL",
            help="Run a site's server: a leaf node of the hub at HUB_URL (its leafnode port, "
            "nats-leaf://host:7422) with its own JetStream domain (--domain SITE).",
        ),
    ] = None,
    domain: Annotated[
        str | None, typer.Option("--domain", help="This server's JetStream domain (a site's name).")
    ] = None,
    leaf_port: Annotated[
        int | None,
        typer.Option(
            "--leaf-port",
            help="Run a hub: accept sites' leaf connections on this port (0: a free one, printed).",
        ),
    ] = None,
    hub_domain: Annotated[
        str, typer.Option("--hub-domain", help="The hub's JetStream domain (a site sources it).")
    ] = "hub",
    leaf_users: Annotated[
        Path | None,
        typer.Option(
            "--leaf-users",
            help="A hub's leaf logins: the block `meshforge permissions leaf --site S` prints. "
            "A site logs in with MESHFORGE_LEAF_USER / MESHFORGE_LEAF_PASSWORD.",
        ),
    ] = None,
    leaf_host: Annotated[
        str,
        typer.Option("--leaf-host", help="A hub's leafnode address (0.0.0.0: every interface)."),
    ] = "127.0.0.1",
) -> None:
    """Run the embedded nats-server (JetStream on, data under ./.meshforge/) until Ctrl-C.

    With --cluster N, run N servers routed on loopback instead, each with its own data
    directory, and print their client URLs once JetStream has a meta leader. With
    --leaf-port, run a hub that sites join; with --leaf HUB_URL --domain SITE, a site.
    """
    HOME.mkdir(parents=True, exist_ok=True)
    if cluster:
        _serve_cluster(cluster, port)
        return
    users = _read(leaf_users) if leaf_users is not None else ""
    make = _fleet_server(leaf, domain, leaf_port, hub_domain, leaf_host, users)
    with embedded_server(HOME, port=port, make=make) as srv:
        typer.echo(f"nats-server listening on {srv.url} (data in {srv.store_dir})")
        if leaf_port is not None:
            from meshforge.control.sites import hub_leaf_port

            bound = leaf_port or hub_leaf_port(srv)  # 0: the port the hub picked
            typer.echo(
                f"hub (JetStream domain {domain or hub_domain}): sites join at nats-leaf://{leaf_host}:{bound}"
            )
        if leaf is not None and domain is not None:
            _link_in_background(srv.url, domain, hub_domain)
        typer.echo(f"use it with: export MESHFORGE_NATS_URL={srv.url}")
        _stop_on_sigterm()
        try:
            srv.wait()
        except KeyboardInterrupt:
            typer.echo("stopping nats-server")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise typer.BadParameter(str(exc), param_hint="--leaf-users") from None


def _fleet_server(
    leaf: str | None,
    domain: str | None,
    leaf_port: int | None,
    hub_domain: str,
    leaf_host: str,
    leaf_users: str,
) -> Callable[[Path, int | None], EmbeddedServer] | None:
    """How to make the server for the hub / site options (None: a plain server)."""
    from meshforge.control.sites import hub_server, site_server

    if leaf is not None and leaf_port is not None:
        raise typer.BadParameter("a server is a hub (--leaf-port) or a site (--leaf), not both")
    if leaf is not None:
        if domain is None:
            raise typer.BadParameter("a site needs its name as --domain SITE", param_hint="--leaf")
        site = domain
        user, password = (
            os.environ.get("MESHFORGE_LEAF_USER"),
            os.environ.get("MESHFORGE_LEAF_PASSWORD"),
        )
        return lambda store, port: site_server(
            site, leaf, store_dir=store, port=port, user=user, password=password
        )
    if leaf_port is not None:
        hub = domain or hub_domain
        return lambda store, port: hub_server(
            store,
            leaf_port=leaf_port,
            domain=hub,
            port=port,
            leaf_host=leaf_host,
            leaf_users=leaf_users,
        )
    if domain is not None:
        raise typer.BadParameter("--domain goes with --leaf (a site) or --leaf-port (a hub)")
    return None


def _link_in_background(url: str, site: str, hub_domain: str) -> None:
    """Provision the site and the hub for each other once the leaf link is up (retried)."""
    import asyncio
    import threading
    import time

    from meshforge.control.sites import link_site

    def work() -> None:
        while True:
            try:
                changes = asyncio.run(link_site(url, site, hub_domain=hub_domain, timeout=2.0))
            except Exception as exc:  # the hub is not reachable yet: try again
                typer.echo(f"site {site}: waiting for the hub ({type(exc).__name__})", err=True)
                time.sleep(5)  # the retry period while the link is down
                continue
            typer.echo(f"site {site} linked to the hub" + "".join(f"\n  {c}" for c in changes))
            return

    threading.Thread(target=work, name=f"link-{site}", daemon=True).start()


def _serve_cluster(size: int, port: int | None) -> None:
    from meshforge.transport.cluster import EmbeddedCluster

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
