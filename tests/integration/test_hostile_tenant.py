"""Issue 29: two tenants (and two sites) on one server, every user granted exactly what
`meshforge permissions` prints. The hostile tenant tries every subscription and every
JetStream API call its permissions allow, and every publish into the other's subjects:
it gets none of the other tenant's commands, events, replies or PubAcks, and stores
nothing there."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from ops_support import Child
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.config import Settings, load_settings
from meshforge.control.presence import nodes_bucket
from meshforge.envelope import Envelope
from meshforge.publish.publisher import Publisher
from meshforge.topology.permissions import password_variable
from meshforge.topology.provision import ensure
from meshforge.topology.specs import agent_consumer, default_streams, node_consumer
from meshforge.topology.subjects import STREAM_EVENTS, STREAM_FAILED
from meshforge.transport.connection import Connection, connect
from meshforge.transport.server import EmbeddedServer
from polling import wait_until

# user: the `meshforge permissions` arguments that print its block
USERS = {
    "ops-admin": ["admin"],
    "acme-worker": ["agent", "--agent", "order", "--tenant", "acme"],
    "evil-worker": ["agent", "--agent", "order", "--tenant", "evil"],
    "acme-pub": ["publisher", "--tenant", "acme"],
    "evil-pub": ["publisher", "--tenant", "evil"],
    "site1-node": ["node", "--site", "site1", "--node", "n1"],
    "site2-node": ["node", "--site", "site2", "--node", "n2"],
    "ops": ["publisher", "--subject", "control.cmd.site1.n1", "--subject", "control.cmd.site2.n2"],
}
HOSTILE = ("evil-pub", "evil-worker", "site2-node")
ACME_DURABLE = agent_consumer("order", Settings(tenant="acme")).durable
# Everything a hostile user may try to subscribe to, its own inbox and wildcards included.
SUBSCRIPTIONS = (
    "_INBOX.>", ">", "*.>", "*.*.>", "_INBOX_acme-pub.>", "_INBOX_acme-worker.>",
    "_INBOX_site1-node.>", "_INBOX_ops.>", "_INBOX_ops-admin.>", "cmd.>", "evt.>", "failed.>",
    "control.>", "$JS.>", "$KV.>",
)  # fmt: skip
# What belongs to acme or site1: publishing to any of it is refused.
FOREIGN = (
    "cmd.acme.demo.order.create", "evt.acme.demo.order.created", "failed.cmd.acme.demo.order.create",
    "control.cmd.site1.n1", "control.reply.site1.n1", "$KV.MESHFORGE_NODES.site1.n1",
    f"$JS.ACK.MESHFORGE_COMMANDS.{ACME_DURABLE}.1.1.1.1.1.1",
    f"$JS.API.CONSUMER.MSG.NEXT.MESHFORGE_COMMANDS.{ACME_DURABLE}",
    "$JS.API.CONSUMER.CREATE.MESHFORGE_COMMANDS", "$JS.API.STREAM.MSG.GET.MESHFORGE_EVENTS",
    "$JS.API.DIRECT.GET.MESHFORGE_EVENTS", "$JS.API.CONSUMER.MSG.NEXT.MESHFORGE_CONTROL.node_site1_n1",
)  # fmt: skip


def password(user: str) -> str:
    return f"pw-{user}-29"


def printed_config() -> str:
    """One authorization block holding each user exactly as `meshforge permissions` prints it."""
    entries = []
    for user, args in USERS.items():
        result = CliRunner().invoke(app, ["permissions", *args, "--user", user])
        assert result.exit_code == 0, result.output
        entries.append(result.output.split("users = [\n", 1)[1].rsplit("\n  ]\n}", 1)[0])
    return "authorization {\n  users = [\n" + "\n".join(entries) + "\n  ]\n}\n"


@dataclass
class Hostile:
    """A raw NATS client of a hostile user: it picks its own inbox and keeps all it gets."""

    user: str
    nc: NATS
    got: list[tuple[str, Msg]] = field(default_factory=list)  # (subscription, message)
    errors: list[str] = field(default_factory=list)

    def texts(self) -> str:
        return "\n".join(f"{sub}: {m.subject} {m.data!r} {m.headers}" for sub, m in self.got)


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmbeddedServer]:
    for user in USERS:
        monkeypatch.setenv(password_variable(user), password(user))
    conf = tmp_path / "auth.conf"
    conf.write_text(printed_config())
    with EmbeddedServer(store_dir=tmp_path / "nats", extra_args=["-c", str(conf)]) as srv:
        yield srv


def settings(user: str, **more: str) -> Settings:
    return load_settings(
        {"user": user, "password": password(user), "connect_attempts": 1, **more}, env={}
    )


@pytest.fixture
async def admin(server: EmbeddedServer) -> AsyncIterator[Connection]:
    """Streams, both tenants' durables, both nodes' mailboxes and the presence bucket."""
    conn = await connect(settings("ops-admin"), url=server.url)
    s = Settings()
    consumers = [agent_consumer("order", Settings(tenant=t)) for t in ("acme", "evil")]
    consumers += [node_consumer("site1", "n1", s), node_consumer("site2", "n2", s)]
    await ensure(conn.js, default_streams(s), consumers)
    await nodes_bucket(conn.js, create=True)
    yield conn
    await conn.close()


async def hostile(server: EmbeddedServer, user: str) -> Hostile:
    spy = Hostile(user, NATS())

    async def on_error(exc: Exception) -> None:
        spy.errors.append(str(exc))

    def keeper(subject: str) -> Callable[[Msg], Awaitable[None]]:
        async def keep(msg: Msg) -> None:
            spy.got.append((subject, msg))

        return keep

    await spy.nc.connect(
        server.url, user=user, password=password(user), error_cb=on_error, allow_reconnect=False
    )
    for subject in (*SUBSCRIPTIONS, f"_INBOX_{user}.>"):
        await spy.nc.subscribe(subject, cb=keeper(subject))
    await spy.nc.flush()
    return spy


def child(args: list[str], user: str, log: Path, **env: str) -> Child:
    return Child(
        args, log, env={"MESHFORGE_USER": user, "MESHFORGE_PASSWORD": password(user), **env}
    )


async def stored(admin: Connection, stream: str, subjects: str) -> int:
    info = await admin.js.stream_info(stream, subjects_filter=subjects)
    return sum((info.state.subjects or {}).values())


async def test_a_hostile_tenant_and_site_get_nothing_of_the_others_on_the_wire(
    server: EmbeddedServer, admin: Connection, tmp_path: Path
) -> None:
    spies = [await hostile(server, user) for user in HOSTILE]
    secret, site_secret = f"acme-secret-{uuid.uuid4().hex}", f"site1-secret-{uuid.uuid4().hex}"
    url = ["--nats-url", server.url, "--no-provision"]
    procs = [
        child(["run", "meshforge.demo:OrderAgent", *url, "--store", f"sqlite:///{tmp_path / f'{t}.db'}"],
              f"{t}-worker", tmp_path / f"{t}-worker.log", MESHFORGE_TENANT=t)
        for t in ("acme", "evil")
    ] + [
        child(["node", site, node, *url, "--store", f"sqlite:///{tmp_path / f'{site}.db'}"],
              f"{site}-node", tmp_path / f"{site}-node.log")
        for site, node in (("site1", "n1"), ("site2", "n2"))
    ]  # fmt: skip
    acme = await connect(settings("acme-pub"), url=server.url)
    evil = await connect(settings("evil-pub"), url=server.url)
    ops = await connect(settings("ops"), url=server.url)
    try:
        for i in range(5):
            body = {"order_id": f"a-{i}", "sku": secret, "qty": 1}
            await Publisher(acme.js).publish(
                "cmd.acme.demo.order.create", Envelope.new("order.create", body)
            )
        mine = {"order_id": "e-1", "sku": "evil-own", "qty": 1}
        await Publisher(evil.js).publish(
            "cmd.evil.demo.order.create", Envelope.new("order.create", mine)
        )
        for site, node, say in (("site1", "n1", site_secret), ("site2", "n2", "site2-own")):
            await Publisher(ops.js).publish(
                f"control.cmd.{site}.{node}", Envelope.new("echo", {"say": say})
            )
        for what, stream, subjects, count in (
            ("acme's 5 orders", STREAM_EVENTS, "evt.acme.demo.order.created", 5),
            ("evil's own order", STREAM_EVENTS, "evt.evil.demo.order.created", 1),
            ("site1's reply", "MESHFORGE_REPLIES", "control.reply.site1.n1", 1),
            ("site2's reply", "MESHFORGE_REPLIES", "control.reply.site2.n2", 1),
        ):
            await wait_until(
                lambda s=stream, f=subjects, c=count: _at_least(admin, s, f, c), 60, what
            )  # type: ignore[misc]
        await _try_everything(spies)
    finally:
        for conn in (acme, evil, ops):
            await conn.close()
        codes = [proc.stop() for proc in procs]
        for spy in spies:
            await spy.nc.close()
    assert codes == [0, 0, 0, 0], [p.output() for p in procs]
    for spy in spies:
        got = spy.texts()
        assert secret not in got and site_secret not in got, (
            f"{spy.user} read another tenant's traffic:\n{got}"
        )
        # Only its own inbox ever delivered: its own replies (and its user's own pulls and PubAcks).
        assert {sub for sub, _ in spy.got} <= {f"_INBOX_{spy.user}.>"}, got
    evil_pub = next(spy for spy in spies if spy.user == "evil-pub")
    assert evil_pub.got, "the hostile user's own inbox got nothing: the spy did not listen"
    # Nothing hostile was stored on acme's or site1's subjects, and every try was refused.
    assert await stored(admin, STREAM_EVENTS, "evt.acme.>") == 5
    assert await stored(admin, STREAM_FAILED, "failed.>") == 0
    assert await stored(admin, "MESHFORGE_REPLIES", "control.reply.site1.n1") == 1
    log = server.log_file.read_text()
    for spy in spies:
        for subject in FOREIGN:
            assert f'"{subject}"' in _violations(log, spy.user), (
                f"{spy.user} was not refused {subject}"
            )
        for subject in SUBSCRIPTIONS:
            assert f'"{subject}"' in _violations(log, spy.user, "Subscription"), (
                f"{spy.user} may subscribe {subject}"
            )


async def _at_least(admin: Connection, stream: str, subjects: str, count: int) -> bool:
    return await stored(admin, stream, subjects) >= count


async def _try_everything(spies: list[Hostile]) -> None:
    """Every JetStream API request the hostile users are granted, then every foreign publish."""
    for spy in spies:
        args = ["permissions", *USERS[spy.user], "--user", spy.user]
        block = CliRunner().invoke(app, args).output
        granted = [
            line.strip().strip('"')
            for line in block.splitlines()
            if line.strip().startswith('"$JS.API.')
        ]
        for subject in granted:
            body = {"batch": 10, "expires": 200_000_000} if ".MSG.NEXT." in subject else {}
            if subject.endswith(".>"):
                subject = subject[:-2] + ".anything"
            try:
                await spy.nc.request(subject, json.dumps(body).encode(), timeout=0.5)
            except Exception as exc:  # a denial or an empty pull: only what comes back counts
                spy.errors.append(f"{subject}: {exc}")
        for subject in FOREIGN:
            await spy.nc.publish(subject, b"{}", reply=f"_INBOX_{spy.user}.x")
        await spy.nc.flush()


def _violations(log: str, user: str, kind: str = "Publish") -> str:
    """The server's refusals of ``kind`` for ``user``: the log names the user and the subject."""
    return "\n".join(
        line
        for line in log.splitlines()
        if f"{kind} Violation" in line and f'/user:{user}"' in line
    )
