"""The console's Contract page: the AsyncAPI document of the agents it was given, shown
read-only to any signed-in role, escaped, under the console's CSP."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from console_client import Browser, running
from starlette.applications import Starlette

from meshforge.config import load_settings
from meshforge.console import create_app
from meshforge.console.auth import CSP, ConsoleTokens
from meshforge.contract import asyncapi
from meshforge.control.node import CommandContext, Node, command
from meshforge.demo import DemoNode, InventoryAgent, OrderAgent
from meshforge.envelope import Envelope
from meshforge.runtime.agent import Agent, Event, Output
from meshforge.runtime.agent import command as agent_command

VIEWER = "viewer-" + uuid.uuid4().hex
TOKENS = ConsoleTokens(viewer=VIEWER, operator="operator-" + uuid.uuid4().hex)
HOSTILE = "<script>alert('contract')</script>"


class HostileState(msgspec.Struct):
    n: int = 0


class HostileAgent(Agent[HostileState]):
    """Counts <script>alert('contract')</script> things."""

    name = "hostile"

    @agent_command("poke")
    def poke(self, cmd: Envelope, state: HostileState) -> list[Output]:
        """Pokes <script>alert('contract')</script> once."""
        return [Event("poked", {})]


class HostileNode(Node):
    """A node of <img src=x onerror=alert(1)> claims."""

    @command()
    async def knock(self, payload: dict[str, Any], ctx: CommandContext) -> Any:
        """Knocks <script>alert('contract')</script>."""
        return None


def _app(nats_url: str, **kwargs: Any) -> Starlette:
    settings = load_settings({"nats_url": nats_url, **kwargs.pop("settings", {})}, env={})
    return create_app(settings, nats_url=nats_url, tokens=TOKENS, **kwargs)


@pytest.fixture
async def app(nats_url: str) -> AsyncIterator[Starlette]:
    agents = [OrderAgent(), InventoryAgent(), HostileAgent()]
    async with running(_app(nats_url, agents=agents, nodes=[DemoNode(), HostileNode()])) as found:
        yield found


async def _viewer_get(app: Starlette, path: str) -> Any:
    return await Browser(app).get(path, authorization=f"Bearer {VIEWER}")


async def test_a_viewer_sees_every_operation_of_the_agents_and_nodes(app: Starlette) -> None:
    shown = await _viewer_get(app, "/contract")
    assert shown.status == 200, shown.text
    doc = asyncapi([OrderAgent, InventoryAgent, HostileAgent], [DemoNode(), HostileNode()])
    for op_id in doc["operations"]:
        assert f'id="op-{op_id}"' in shown.text, op_id
    assert "cmd.{tenant}.{namespace}.order.create" in shown.text
    assert "control.reply.{site}.{node}" in shown.text
    assert "Dlq-Reason" in shown.text and "Nats-Msg-Id" in shown.text
    download = await _viewer_get(app, "/contract.json")
    assert download.status == 200 and json.loads(download.body) == doc


async def test_descriptions_are_escaped_under_the_consoles_csp(app: Starlette) -> None:
    shown = await _viewer_get(app, "/contract")
    assert HOSTILE not in shown.text and "<img src=x" not in shown.text
    assert "&lt;script&gt;alert(&#39;contract&#39;)&lt;/script&gt;" in shown.text
    assert "&lt;img src=x onerror=alert(1)&gt;" in shown.text
    assert shown.header("content-security-policy") == CSP
    scripts = re.findall(r"<script[^>]*>", shown.text)
    assert scripts and all(
        re.fullmatch(r'<script src="/static/[a-z.]+" defer>', s) for s in scripts
    )


async def test_the_page_needs_a_sign_in(app: Starlette) -> None:
    for path in ("/contract", "/contract.json"):
        assert (await Browser(app).get(path)).status == 401


async def test_without_agents_the_page_says_how_to_give_them(nats_url: str) -> None:
    async with running(_app(nats_url)) as bare:
        shown = await _viewer_get(bare, "/contract")
        assert shown.status == 200 and 'id="no-contract"' in shown.text
        assert "--agent MODULE:AGENT" in shown.text
        assert (await _viewer_get(bare, "/contract.json")).status == 404


async def test_a_console_bound_to_a_tenant_shows_its_tenant_and_no_nodes(nats_url: str) -> None:
    app = _app(nats_url, settings={"tenant": "acme"}, agents=[OrderAgent()], nodes=[DemoNode()])
    async with running(app) as bound:
        doc = json.loads((await _viewer_get(bound, "/contract.json")).body)
        assert doc["components"]["parameters"]["tenant"]["enum"] == ["acme"]
        assert not any(op.startswith("control.") for op in doc["operations"])
