"""Sites on leaf nodes: a site's nats-server is a leaf node of the hub with its own
JetStream domain, and the control plane's streams cross the link only by sourcing.

* The site's mailbox stream ``MESHFORGE_CONTROL`` sources ``control.cmd.<site>.>`` from the
  hub's (a work queue: a command leaves the hub once the site holds it). Nodes at the
  site pull their local stream, so a command already at the site runs while the link is cut.
* The hub's ``MESHFORGE_REPLIES`` and presence bucket source the site's: replies and
  announcements made during a cut reach the hub when the link returns.
* The site's jobs bucket sources the hub's ``cancel.*`` keys, so a node at the site
  answers CANCELED to a canceled job's command without asking the hub.
* The leaf connection itself denies ``control.>`` and those buckets' subjects both ways:
  every message crosses once, through a source, never also directly.

Example::

    with site_server("plant3", "nats-leaf://hub:7422", store_dir="/var/lib/site") as srv:
        asyncio.run(link_site(srv.url, "plant3"))
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from nats.js import JetStreamContext
from nats.js.api import ExternalStream, StreamSource

from meshforge.config import Settings, load_settings
from meshforge.control.jobs import JOBS_BUCKET, jobs_bucket
from meshforge.control.presence import NODES_BUCKET, nodes_bucket
from meshforge.errors import ServerError
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_CONTROL, STREAM_REPLIES, validate_token
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer

__all__ = [
    "HUB_DOMAIN",
    "LINK_DENY",
    "hub_leaf_port",
    "hub_server",
    "link_site",
    "server_config",
    "site_server",
]

HUB_DOMAIN = "hub"
# Subjects kept off the leaf connection: they cross by sourcing only.
LINK_DENY = ("control.>", f"$KV.{NODES_BUCKET}.>", f"$KV.{JOBS_BUCKET}.>")


def _kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def server_config(
    *,
    domain: str,
    leaf_listen: str | None = None,
    hub_url: str | None = None,
    leaf_users: str = "",
) -> str:
    """The nats-server config for a hub (``leaf_listen``: its leafnode ``host:port``;
    ``leaf_users``: the ``authorization`` block ``meshforge permissions leaf`` prints) or a
    site (``hub_url``: the hub's leafnode URL), each with its own JetStream domain.

    >>> print(server_config(domain="hub", leaf_listen="127.0.0.1:7422"))
    jetstream { domain: "hub" }
    leafnodes { listen: "127.0.0.1:7422", no_advertise: true }
    """
    lines = [f"jetstream {{ domain: {json.dumps(validate_token(domain, 'domain'))} }}"]
    if leaf_listen is not None:
        # no_advertise: a site dials the URL it was given (its proxy, its tunnel), no other.
        auth = f"\n{leaf_users.strip()}\n" if leaf_users.strip() else " "
        lines.append(f"leafnodes {{ listen: {json.dumps(leaf_listen)}, no_advertise: true{auth}}}")
    if hub_url is not None:
        deny = json.dumps(list(LINK_DENY))
        lines.append(
            f"leafnodes {{ remotes: [ {{ url: {json.dumps(hub_url)}, "
            f"deny_imports: {deny}, deny_exports: {deny} }} ] }}"
        )
    return "\n".join(lines) + "\n"


def _configured(store_dir: Path, text: str, **options: object) -> EmbeddedServer:
    store_dir.mkdir(parents=True, exist_ok=True)
    path = store_dir / "meshforge-site.conf"
    path.write_text(text)
    os.chmod(path, 0o600)
    return EmbeddedServer(store_dir=store_dir, extra_args=["-c", str(path)], **options)  # type: ignore[arg-type]


def hub_server(
    store_dir: str | os.PathLike[str],
    *,
    leaf_port: int,
    domain: str = HUB_DOMAIN,
    port: int | None = None,
    leaf_host: str = "127.0.0.1",
    leaf_users: str = "",
) -> EmbeddedServer:
    """The hub: JetStream domain ``domain``, leaf connections accepted on ``leaf_host:leaf_port``
    (from the users of ``leaf_users`` only, when given). ``leaf_port=0``: a free port the
    server picks itself (again at each start); ``hub_leaf_port`` tells it once the hub runs."""
    # nats-server's "any free port" is -1 (0 would turn the leafnode listener off).
    listen = f"{leaf_host}:{leaf_port if leaf_port else -1}"
    text = server_config(domain=domain, leaf_listen=listen, leaf_users=leaf_users)
    return _configured(Path(store_dir), text, port=port)


def hub_leaf_port(hub: EmbeddedServer, timeout: float = 5.0) -> int:
    """The leafnode port a running hub listens on, from its monitoring endpoint (``/varz``)."""
    url = f"http://{hub.host}:{hub.monitor_port}/varz"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        leaf = json.loads(resp.read()).get("leaf") or {}
    port = leaf.get("port")
    if not port:
        raise ServerError(f"{hub.url} accepts no leaf connections (no leaf port in {url})")
    return int(port)


def site_server(
    site: str,
    hub_url: str,
    *,
    store_dir: str | os.PathLike[str],
    port: int | None = None,
    user: str | None = None,
    password: str | None = None,
) -> EmbeddedServer:
    """A site's server: a leaf node of the hub at ``hub_url``, JetStream domain ``site``;
    ``user``/``password`` log the link in (written only to the config file, mode 0600)."""
    url = hub_url
    if user is not None and password is not None:
        parts = urlsplit(hub_url)
        login = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}"
        url = urlunsplit(parts._replace(netloc=f"{login}:{parts.port}" if parts.port else login))
    return _configured(Path(store_dir), server_config(domain=site, hub_url=url), port=port)


async def _add_source(js: JetStreamContext, stream: str, source: StreamSource) -> bool:
    """Add ``source`` to ``stream`` unless it has it; True when the config changed."""
    config = (await js.stream_info(stream)).config
    sources: list[StreamSource] = list(config.sources or [])
    api = source.external.api if source.external else None
    for have in sources:
        if have.name == source.name and (have.external.api if have.external else None) == api:
            return False
    config.sources = [*sources, source]
    await js.update_stream(config)
    return True


def _external(domain: str, stream: str, subject: str | None = None) -> StreamSource:
    return StreamSource(
        name=stream, filter_subject=subject, external=ExternalStream(api=f"$JS.{domain}.API")
    )


async def link_site(
    site_url: str,
    site: str,
    *,
    hub_domain: str = HUB_DOMAIN,
    settings: Settings | None = None,
    timeout: float = 10.0,  # noqa: ASYNC109
) -> list[str]:
    """Provision a site and its hub for each other (idempotent); the changes made.

    Talks to the site's server only: the hub is reached through the leaf link, by its
    domain's API, so the link must be up (a ``TimeoutError``/``NoRespondersError`` says not).
    """
    validate_token(site, "site")
    settings = settings or load_settings()
    changes: list[str] = []
    async with await connect(settings, url=site_url, name=f"meshforge-site-{site}") as conn:
        local = conn.js
        hub = conn.nc.jetstream(domain=hub_domain, timeout=timeout)
        streams = default_streams(settings)
        await ensure(local, streams, [])
        await nodes_bucket(local, create=True, replicas=settings.replicas)
        await jobs_bucket(local, create=True, replicas=settings.replicas)
        await ensure(hub, streams, [])
        await nodes_bucket(hub, create=True, replicas=settings.replicas)
        await jobs_bucket(hub, create=True, replicas=settings.replicas)
        wiring: Sequence[tuple[JetStreamContext, str, StreamSource, str]] = (
            (local, STREAM_CONTROL, _external(hub_domain, STREAM_CONTROL, f"control.cmd.{site}.>"),
             f"{site}: {STREAM_CONTROL} sources the hub's control.cmd.{site}.>"),
            (local, _kv_stream(JOBS_BUCKET),
             _external(hub_domain, _kv_stream(JOBS_BUCKET), f"$KV.{JOBS_BUCKET}.cancel.>"),
             f"{site}: {JOBS_BUCKET} sources the hub's cancellations"),
            (hub, STREAM_REPLIES, _external(site, STREAM_REPLIES),
             f"hub: {STREAM_REPLIES} sources {site}'s replies"),
            (hub, _kv_stream(NODES_BUCKET), _external(site, _kv_stream(NODES_BUCKET)),
             f"hub: {NODES_BUCKET} sources {site}'s presence"),
        )  # fmt: skip
        for js, stream, source, what in wiring:
            if await _add_source(js, stream, source):
                changes.append(what)
    return changes
