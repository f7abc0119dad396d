"""What every command shares: the NATS URL option and the embedded-server fallback."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from meshforge.transport.server import DataDirLock, EmbeddedServer

if TYPE_CHECKING:
    from rich.console import Console

    from meshforge.config import Settings
    from meshforge.control.node import Node
    from meshforge.runtime.agent import Agent

#: Width of output that goes to a pipe or file: wide enough that no line is folded mid-word.
PIPED_WIDTH = 1000


def console() -> Console:
    """A rich console: the terminal's width, or (piped, COLUMNS unset) no folding at 80."""
    import sys

    from rich.console import Console

    wide = not sys.stdout.isatty() and not os.environ.get("COLUMNS")
    return Console(width=PIPED_WIDTH if wide else None)


NatsUrl = Annotated[
    str | None,
    typer.Option(
        "--nats-url",
        envvar="MESHFORGE_NATS_URL",
        help=(
            "NATS server URL; without one an embedded server is started under ./.meshforge/. "
            "Credentials and TLS come from MESHFORGE_USER/_PASSWORD, _TOKEN, _NKEY_SEED(_FILE), "
            "_CREDS_FILE, _TLS_CA/_CERT/_KEY (see docs/SECURITY.md)."
        ),
        show_default=False,
    ),
]

StoreUrl = Annotated[
    str | None,
    typer.Option(
        "--store",
        envvar="MESHFORGE_STORE_URL",
        help="sqlite:///path (default ./.meshforge/store.db) or postgresql://...",
        show_default=False,
    ),
]

NoProvision = Annotated[
    bool,
    typer.Option("--no-provision", help="Use existing streams and consumers; fail if missing."),
]

MetricsPort = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        min=0,
        max=65535,
        help="Serve /healthz /readyz /metrics on this port (0: a free one).",
        show_default=False,
    ),
]

MetricsHost = Annotated[
    str | None,
    typer.Option(
        "--metrics-host",
        help="Address the metrics endpoint listens on (default 127.0.0.1; 0.0.0.0 for every interface).",
        show_default=False,
    ),
]

HOME = Path(os.environ.get("MESHFORGE_HOME", ".meshforge"))
SERVER_FILE = "server.json"


def _running_embedded(home: Path) -> str | None:
    """URL of an embedded server another meshforge process runs from ``home``, if alive."""
    try:
        info = json.loads((home / SERVER_FILE).read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    url = info.get("url")
    return url if isinstance(url, str) else None


@contextlib.contextmanager
def serving_home(home: Path) -> Iterator[DataDirLock]:
    """Lock ``home`` for the embedded server(s) about to start there (one set-up per home).

    Raises ``ServerError`` naming the running one when another process serves ``home``.
    """
    lock = DataDirLock(home).acquire()
    try:
        yield lock
    finally:
        lock.release()


@contextlib.contextmanager
def announced(
    lock: DataDirLock, pid: int, url: str, *, server_pid: int | None = None
) -> Iterator[None]:
    """Write ``home/server.json`` so other commands find the server; remove it only if still ours.

    ``pid`` is the process whose life the URL follows; the lock file names the holder.
    """
    holder: dict[str, object] = {"pid": os.getpid(), "url": url}
    if server_pid is not None:
        holder["server_pid"] = server_pid
    lock.record(**holder)
    marker = lock.directory / SERVER_FILE
    marker.write_text(json.dumps({"pid": pid, "url": url}))
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(marker.read_text()).get("pid") == pid:
                marker.unlink()


@contextlib.contextmanager
def embedded_server(
    home: Path = HOME,
    port: int | None = None,
    make: Callable[[Path, int | None], EmbeddedServer] | None = None,
) -> Iterator[EmbeddedServer]:
    """Start the embedded server with its data under ``home`` and announce its URL there.

    ``home`` and the server's store directory are locked: a second server on the same
    ``home`` raises ``ServerError`` naming the running one, before touching any file.
    """
    with serving_home(home) as lock:
        store_dir = home / "nats"
        server = make(store_dir, port) if make else EmbeddedServer(store_dir=store_dir, port=port)
        server.start()
        assert server.pid is not None
        try:
            with announced(lock, server.pid, server.url, server_pid=server.pid):
                yield server
        finally:
            server.close()


@contextlib.contextmanager
def nats_target(url: str | None, home: Path = HOME) -> Iterator[str]:
    """The URL to use: the given one, an embedded server already running, or a new one."""
    if url:
        yield url
        return
    running = _running_embedded(home)
    if running:
        yield running
        return
    home.mkdir(parents=True, exist_ok=True)
    with embedded_server(home) as server:
        typer.secho(
            f"embedded nats-server at {server.url} (data in {home}/nats)", err=True, dim=True
        )
        yield server.url


def service_settings(
    *,
    store: str | None,
    nats_url: str | None,
    no_provision: bool,
    metrics_port: int | None,
    metrics_host: str | None,
    **more: Any,
) -> Settings:
    """Settings for a long-running command (``run``, ``node``): its options over the
    environment and the defaults (an option left out keeps what they say)."""
    from meshforge.config import load_settings

    return load_settings(
        {
            "store_url": store,
            "nats_url": nats_url,
            "provision": False if no_provision else None,
            "metrics_port": metrics_port,
            "metrics_host": metrics_host,
            **more,
        }
    )


def json_payload(text: str | None) -> dict[str, Any]:
    """A command's JSON payload argument as an object (empty when not given)."""
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not valid JSON: {exc}", param_hint="JSON") from None
    if not isinstance(value, dict):
        raise typer.BadParameter(
            f"expected a JSON object, got {type(value).__name__}", param_hint="JSON"
        )
    return value


Agents = Annotated[
    list[str] | None,
    typer.Option(
        "--agent", metavar="MODULE:AGENT", help="An agent whose contract to show (repeatable)."
    ),
]
Nodes = Annotated[
    list[str] | None,
    typer.Option(
        "--nodes",
        "--node",
        metavar="MODULE:NODE",
        help="A control-plane node class whose commands to add (repeatable).",
    ),
]


def load_contract_parts(
    agents: list[str] | None, nodes: list[str] | None
) -> tuple[list[Agent[Any]], list[Node]]:
    """The agents and nodes named ``MODULE:NAME`` (modules of the current directory too);
    any failure, an exception raised by the module itself included, is one ConfigError."""
    from meshforge.control.node import load_node
    from meshforge.runtime.worker import import_from_cwd, load_agent

    import_from_cwd()
    return [_loaded(spec, load_agent) for spec in agents or []], [
        _loaded(spec, load_node) for spec in nodes or []
    ]


def _loaded(spec: str, load: Callable[[str], Any]) -> Any:
    from meshforge.errors import ConfigError, MeshForgeError, one_line

    try:
        return load(spec)
    except MeshForgeError:
        raise
    except Exception as exc:
        raise ConfigError(f"{spec!r}: cannot load it: {one_line(exc)}") from None
