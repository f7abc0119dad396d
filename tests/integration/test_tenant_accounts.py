"""The account-per-tenant set-up of docs/SECURITY.md, run as written: each tenant has a
NATS account with JetStream and MeshForge's streams of its own; a user of the other
account, allowed everything in its own, sees nothing of it."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from auth_support import configured_server
from nats.aio.msg import Msg
from test_engine_support import running, settings_for

from meshforge.demo import OrderAgent
from meshforge.envelope import Envelope
from meshforge.publish.publisher import Publisher
from meshforge.topology.provision import ensure
from meshforge.topology.specs import agent_consumer, default_streams
from meshforge.topology.subjects import STREAM_EVENTS
from meshforge.transport.connection import connect
from polling import wait_until

ROOT = Path(__file__).resolve().parents[2]


def documented_config() -> str:
    """The server configuration docs/SECURITY.md gives for one account per tenant."""
    doc = (ROOT / "docs" / "SECURITY.md").read_text()
    found = re.search(r"<!-- account-per-tenant -->\s*```\n(.*?)```", doc, re.DOTALL)
    assert found, "docs/SECURITY.md lost its account-per-tenant example"
    return found.group(1)


async def test_one_account_per_tenant_keeps_everything_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for user in ("ACME", "GLOBEX"):
        monkeypatch.setenv(f"{user}_PASSWORD", f"pw-{user}")
    with configured_server(tmp_path / "server", documented_config()) as server:
        acme = settings_for(
            server.url, f"sqlite:///{tmp_path / 'acme.db'}", user="acme", password="pw-ACME"
        )
        globex = settings_for(
            server.url, f"sqlite:///{tmp_path / 'globex.db'}", user="globex", password="pw-GLOBEX"
        )
        secret = f"acme-secret-{uuid.uuid4().hex}"
        seen: list[Msg] = []

        async def spy(msg: Msg) -> None:
            seen.append(msg)

        async with await connect(acme) as mine, await connect(globex) as theirs:
            for conn, s in (
                (mine, acme),
                (theirs, globex),
            ):  # each tenant provisions its own account
                await ensure(conn.js, default_streams(s), [agent_consumer("order", s)])
            for subject in (">", "$JS.>", "_INBOX.>", "_INBOX_acme.>"):  # all its account allows
                await theirs.nc.subscribe(subject, cb=spy)
            await theirs.nc.flush()
            async with running([OrderAgent()], acme):
                for i in range(3):
                    body = {"order_id": f"a-{i}", "sku": secret, "qty": 1}
                    env = Envelope.new("order.create", body)
                    await Publisher(mine.js).publish("cmd.default.demo.order.create", env)

                async def landed() -> bool:
                    return (await mine.js.stream_info(STREAM_EVENTS)).state.messages >= 3

                await wait_until(landed, 30, "acme's three order.created events")
            assert (await theirs.js.stream_info(STREAM_EVENTS)).state.messages == 0
            await theirs.nc.flush()
        assert any(m.subject.startswith("_INBOX_globex.") for m in seen), (
            "the spy heard nothing, not even itself"
        )
        assert not any(secret.encode() in m.data for m in seen)
        assert not any(m.subject.startswith(("cmd.", "evt.", "_INBOX_acme")) for m in seen), [
            m.subject for m in seen
        ]
