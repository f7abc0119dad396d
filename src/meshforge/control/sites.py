"""Sites on leaf nodes: a site's nats-server is a leaf node of the hub with its own
JetStream domain, and the control plane's streams cross the link only by sourcing.

* The site's mailbox stream ``MESHFORGE_CONTROL`` sources ``control.cmd.<site>.>`` from the
  hub's (a work queue: a command leaves the hub once the site holds it). Nodes at the
  site pull their local stream, so a command already at the site runs while the link is cut.
* The hub's ``MESHFORGE_REPLIES`` and presence bucket source the site's: replies and
  announcements made during a cut reach the hub when the link returns.
* The site's jobs bucket sources the hub's ``cancel.*`` keys, so a node at the site
  answers CANCELED to a canceled job's command without asking the hub.
* Each source reads through a durable consumer on the side that holds the messages, so a
  link back from a cut longer than 10 s resumes within seconds (CONTROL_PLANE.md "Sites").
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
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ExternalStream,
    StreamConsumerSource,
    StreamSource,
)

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


# How often a site whose link dropped dials the hub again (nats-server adds up to as much
# again at random; its default is 1s): a returning link is noticed within 1s.
_LEAF_RECONNECT = "500ms"
# Messages a source's consumer sends before the sourcing side acknowledges them.
_IN_FLIGHT = 1000


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
            f"leafnodes {{ reconnect: {json.dumps(_LEAF_RECONNECT)}, "
            f"remotes: [ {{ url: {json.dumps(hub_url)}, "
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


@dataclass(frozen=True)
class _Source:
    """One stream sourcing another across the link through a durable consumer of its own."""

    source: JetStreamContext  # the side that holds the messages
    stream: str
    filter_subject: str | None
    sourcing: JetStreamContext  # the side that copies them
    into: str
    api: str  # the source side's JetStream API, as the sourcing side reaches it
    consumer: str  # its name on the source side (one per sourcing domain)
    deliver: str  # the subject it delivers on, across the link

    def want(self) -> StreamSource:
        return StreamSource(
            name=self.stream,
            external=ExternalStream(api=self.api),
            consumer=StreamConsumerSource(name=self.consumer, deliver_subject=self.deliver),
        )


def _api(source: StreamSource) -> str | None:
    return source.external.api if source.external else None


async def _wire(link: _Source) -> bool:
    """Source ``link.stream`` into ``link.into`` unless it is; True when anything changed.

    The source side holds a durable push consumer for it (``AckPolicy`` flow control, the
    kind nats-server requires for a source with ``consumer``): when a cut link returns,
    the sourcing server resets that consumer (a 5 s request, retried as soon as a
    heartbeat crosses) instead of creating an ephemeral one (a 30 s request that a link
    returning in the meantime does not cut short) -- CONTROL_PLANE.md "Sites".
    """
    config = (await link.sourcing.stream_info(link.into)).config
    want = link.want()
    sources: list[StreamSource] = list(config.sources or [])
    same = [s for s in sources if s.name == want.name and _api(s) == link.api]
    if same and all(s.consumer == want.consumer for s in same):
        return False
    if same:  # an earlier link's source: its own consumer on the source side goes with it
        sources = [s for s in sources if s not in same]
        config.sources = sources
        await link.sourcing.update_stream(config)
    await link.source.add_consumer(
        link.stream,
        ConsumerConfig(
            durable_name=link.consumer,
            deliver_subject=link.deliver,
            ack_policy=AckPolicy.FLOW_CONTROL,
            flow_control=True,
            idle_heartbeat=1.0,  # the only heartbeat nats-server takes for this ack policy
            max_ack_pending=_IN_FLIGHT,
            filter_subject=link.filter_subject,
        ),
    )
    config.sources = [*sources, want]
    await link.sourcing.update_stream(config)
    return True


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
        sides = {hub_domain: (hub, f"$JS.{hub_domain}.API"), site: (local, f"$JS.{site}.API")}
        wiring = (
            (hub_domain, STREAM_CONTROL, f"control.cmd.{site}.>", site, STREAM_CONTROL,
             f"{site}: {STREAM_CONTROL} sources the hub's control.cmd.{site}.>"),
            (hub_domain, _kv_stream(JOBS_BUCKET), f"$KV.{JOBS_BUCKET}.cancel.>", site,
             _kv_stream(JOBS_BUCKET), f"{site}: {JOBS_BUCKET} sources the hub's cancellations"),
            (site, STREAM_REPLIES, None, hub_domain, STREAM_REPLIES,
             f"hub: {STREAM_REPLIES} sources {site}'s replies"),
            (site, _kv_stream(NODES_BUCKET), None, hub_domain, _kv_stream(NODES_BUCKET),
             f"hub: {NODES_BUCKET} sources {site}'s presence"),
        )  # fmt: skip
        for frm, stream, subject, to, into, what in wiring:
            link = _Source(
                source=sides[frm][0], stream=stream, filter_subject=subject,
                sourcing=sides[to][0], into=into, api=sides[frm][1],
                consumer=f"meshforge-source-{to}",
                deliver=f"_MESHFORGE.source.{frm}.{to}.{stream}",
            )  # fmt: skip
            if await _wire(link):
                changes.append(what)
    return changes
