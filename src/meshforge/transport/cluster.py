"""A local nats-server cluster: several embedded servers routed to each other on loopback.

For trying replicated streams and failover on one machine (``meshforge server --cluster 3``)
and for testing them. Each node is an ``EmbeddedServer`` with its own data directory
(locked, like every embedded server's), its own client, route and monitoring ports,
a ``server_name`` and the shared cluster name, all JetStream-enabled. ``start`` returns
once every node is healthy and JetStream has elected a meta leader.

Example::

    with EmbeddedCluster(3, data_dir=".meshforge/cluster") as cluster:
        print(cluster.url)                  # nats://127.0.0.1:4001,nats://127.0.0.1:4002,...
        cluster.node("meshforge-2").kill()  # SIGKILL one node, as a crash would
        cluster.node("meshforge-2").start() # it rejoins with its data
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Self

from meshforge.errors import ServerError
from meshforge.transport.server import EmbeddedServer, Managed

__all__ = ["EmbeddedCluster", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; a tiny race with other programs)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


_START_RETRIES = 2  # new route ports after a bind failure, on a first start


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _route_port_taken(log_file: Path, since: int) -> bool:
    """Whether the server logged, after byte ``since``, that its route port was in use."""
    try:
        with log_file.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
    except OSError:
        return False
    return any("router" in line and "address already in use" in line for line in text.splitlines())


class EmbeddedCluster(Managed):
    """``size`` JetStream nats-servers in one cluster, routed on ``host``.

    ``port`` gives the first node's client port (the others take the next ones); without
    it every node gets a free port. Nodes are named ``<name>-1`` .. ``<name>-<size>`` and
    keep their data in ``<data_dir>/<node name>``; a restarted node keeps its ports.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        data_dir: str | os.PathLike[str],
        name: str = "meshforge",
        host: str = "127.0.0.1",
        port: int | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        if size < 1:
            raise ServerError(f"a cluster needs at least one node, got {size}")
        self.name = name
        self.host = host
        self.data_dir = Path(data_dir)
        self.start_timeout = start_timeout
        self._started = False
        self.nodes: list[EmbeddedServer] = [
            EmbeddedServer(
                store_dir=self.data_dir / f"{name}-{index}",
                host=host,
                port=None if port is None else port + index - 1,
                start_timeout=start_timeout,
            )
            for index in range(1, size + 1)
        ]
        self._pick_route_ports()

    def _pick_route_ports(self) -> None:
        """Give every node a route port and every route (a node skips the one to itself)."""
        route_ports = [free_port(self.host) for _ in self.nodes]
        routes = ",".join(f"nats://{self.host}:{p}" for p in route_ports)
        for node, node_name, route_port in zip(self.nodes, self.names, route_ports, strict=True):
            node.extra_args = [
                "--server_name", node_name, "--cluster_name", self.name,
                "--cluster", f"nats://{self.host}:{route_port}", "--routes", routes,
            ]  # fmt: skip

    @property
    def names(self) -> list[str]:
        """The nodes' ``server_name``s, in order."""
        return [f"{self.name}-{i}" for i in range(1, len(self.nodes) + 1)]

    def node(self, server_name: str) -> EmbeddedServer:
        """The node called ``server_name`` (as stream info's ``cluster.leader`` names it)."""
        for name, node in zip(self.names, self.nodes, strict=True):
            if name == server_name:
                return node
        raise ServerError(
            f"no node {server_name!r} in cluster {self.name} ({', '.join(self.names)})"
        )

    @property
    def urls(self) -> list[str]:
        """Every node's client URL."""
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """All client URLs separated by commas, as ``--nats-url`` takes them."""
        return ",".join(self.urls)

    def start(self) -> Self:
        """Start every node that is not running and wait for a JetStream meta leader."""
        # Each node's arguments name every route's port, so they cannot be 0: a port picked
        # here can be taken before its node binds it, and a first start retries with new ones.
        retries = 0 if self._started else _START_RETRIES
        while True:
            logged = [_size(node.log_file) for node in self.nodes]
            try:
                for node in self.nodes:
                    node.start()
                self.wait_for_meta_leader()
            except BaseException as exc:
                self.stop()
                taken = isinstance(exc, ServerError) and any(
                    _route_port_taken(node.log_file, since)
                    for node, since in zip(self.nodes, logged, strict=True)
                )
                if not taken or retries == 0:
                    raise
                retries -= 1
                self._pick_route_ports()
                continue
            self._started = True
            return self

    def _jsz(self, node: EmbeddedServer) -> dict[str, Any]:
        url = f"http://{self.host}:{node.monitor_port}/jsz"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                data = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def meta_leader(self) -> str | None:
        """The JetStream meta leader's name as a running node sees it, or None."""
        for node in self.nodes:
            if node.running and node.monitor_port is not None:
                meta = self._jsz(node).get("meta_cluster") or {}
                leader = meta.get("leader")
                if leader:
                    return str(leader)
        return None

    def wait_for_meta_leader(self, timeout: float | None = None) -> str:
        """Block until JetStream has a meta leader; raise ``ServerError`` after ``timeout``."""
        limit = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        delay = 0.05
        while time.monotonic() < deadline:
            leader = self.meta_leader()
            if leader:
                return leader
            time.sleep(delay)  # polling the servers' monitoring endpoint with a deadline
            delay = min(delay * 2, 0.5)
        raise ServerError(f"cluster {self.name} elected no JetStream meta leader within {limit:g}s")

    def wait(self, poll: float = 0.5) -> tuple[str, int]:
        """Block until a node exits; return its name and exit code (``meshforge server``)."""
        while True:
            for name, node in zip(self.names, self.nodes, strict=True):
                code = node.exit_code()
                if code is not None:
                    return name, code
            time.sleep(poll)  # a supervisor's poll; a signal ends it

    def stop(self) -> None:
        """Stop every node gracefully."""
        for node in reversed(self.nodes):
            node.stop()

    def close(self) -> None:
        self.stop()
        for node in self.nodes:
            node.close()
