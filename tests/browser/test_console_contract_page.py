"""The Contract page in a real browser: ``meshforge console --agent ... --node ...`` shows
the agents' and the node's operations, a payload schema opens, and the CSP blocks nothing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

import pytest
from console_support import TOKENS, VIEWER_TOKEN, ConsoleProcess, sign_in
from playwright.async_api import Page, expect

from meshforge.transport.server import EmbeddedServer

DocShot = Callable[[Page, str], Awaitable[None]]


@pytest.fixture(scope="module")
def contract_console(
    console_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConsoleProcess]:
    proc = ConsoleProcess(
        console_server.url,
        tmp_path_factory.mktemp("contract-console"),
        "--agent", "meshforge.demo:OrderAgent",
        "--agent", "meshforge.demo:InventoryAgent",
        "--node", "meshforge.demo:DemoNode",
        env=TOKENS,
    ).start()  # fmt: skip
    yield proc
    proc.stop()


async def test_a_viewer_reads_the_contract_of_the_agents_the_console_was_given(
    contract_console: ConsoleProcess, page: Page, doc_shot: DocShot
) -> None:
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    await sign_in(page, contract_console.url, VIEWER_TOKEN, "vera")
    await page.click("text=Contract")
    row = page.locator('[id="op-cmd.inventory.reserve"]')
    await expect(row).to_contain_text("cmd.{tenant}.{namespace}.inventory.reserve")
    await expect(row).to_contain_text("receive")
    await expect(page.locator('[id="op-evt.order.created"]')).to_contain_text("send")
    echo = page.locator('[id="op-control.DemoNode.echo"]')
    await expect(echo).to_contain_text("control.reply.{site}.{node}")
    schema = row.locator("pre")
    await expect(schema).to_be_hidden()
    await row.locator("summary").click()
    await expect(schema).to_contain_text('"type": "object"')
    await doc_shot(page, "contract")
    assert errors == []  # the policy blocked nothing the page needs
