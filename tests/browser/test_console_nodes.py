"""The console's nodes page in a real browser: presence, and a command sent with its reply."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

import pytest
from console_support import OPERATOR_TOKEN, VIEWER_TOKEN, ConsoleProcess, node_process, sign_in
from playwright.async_api import Page, expect

from meshforge.transport.server import EmbeddedServer
from polling import wait_until

DocShot = Callable[[Page, str], Awaitable[None]]


@pytest.fixture(scope="module")
def demo_node(
    console_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """``meshforge node lab1 n1``: the demo node, announcing itself every second."""
    with node_process(console_server.url, tmp_path_factory.mktemp("node"), "lab1", "n1"):
        yield


async def test_an_operator_sends_a_command_to_a_node_and_sees_its_reply(
    console: ConsoleProcess, demo_node: None, page: Page, doc_shot: DocShot
) -> None:
    await sign_in(page, console.url, OPERATOR_TOKEN, "nadia")
    await page.goto(f"{console.url}/nodes")
    # The table refreshes itself: the node shows up alive once it announced.
    row = page.locator("#node-lab1-n1")
    await expect(row).to_contain_text("alive", timeout=30_000)
    await doc_shot(page, "nodes")

    await page.select_option("#send-target", "lab1/n1")
    await page.fill("#send-command", "echo")
    await page.fill("#send-payload", '{"hello": "from the console"}')
    await page.click("#send")
    await expect(page.locator("#confirm-text")).to_contain_text("Send echo to lab1/n1")
    await page.click("#confirm")
    await expect(page.locator("#reply-status")).to_have_text("ok", timeout=20_000)
    await expect(page.locator("#reply-result")).to_contain_text("from the console")
    await doc_shot(page, "node-reply")
    await wait_until(
        lambda: (
            "nadia (operator via session" in console.log()
            and "sent echo" in console.log()
            and "to lab1/n1" in console.log()
        ),
        what="the audit line of the send",
    )


async def test_a_viewer_sees_nodes_but_no_send_form_and_cannot_send(
    console: ConsoleProcess, demo_node: None, page: Page
) -> None:
    await sign_in(page, console.url, VIEWER_TOKEN, "vera")
    await page.goto(f"{console.url}/nodes")
    await expect(page.locator("#node-lab1-n1")).to_be_visible(timeout=30_000)
    await expect(page.locator("#send-form")).to_have_count(0)
    forged = await page.request.post(
        f"{console.url}/nodes/send",
        form={"target": "lab1/n1", "command": "restart", "confirm": "yes", "csrf": "x"},
        max_redirects=0,
    )
    assert forged.status == 403
