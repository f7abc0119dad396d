"""Fixtures of the browser tests: a server, consoles, and headless Chromium driven by Playwright.

Chromium is Debian's (``/usr/bin/chromium``, installed by ``make setup``); Playwright
drives it and downloads nothing. A test that fails leaves a screenshot of its page in
``.meshforge/screenshots/`` (or ``$MESHFORGE_SCREENSHOT_DIR``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from console_support import (
    DOC_IMAGES,
    ROOT,
    TOKENS,
    ConsoleProcess,
)
from playwright.async_api import Browser, Page, async_playwright

from meshforge.config import Settings, load_settings
from meshforge.testing.plugin import TEST_SETTINGS
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.transport.connection import Connection, connect
from meshforge.transport.server import EmbeddedServer

CHROMIUM = os.environ.get("MESHFORGE_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
SCREENSHOTS = Path(os.environ.get("MESHFORGE_SCREENSHOT_DIR", ROOT / ".meshforge" / "screenshots"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, Any]:
    """Keep each phase's report on the test, so a fixture can see that the test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(scope="module")
def console_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """A server of this module's own: the consoles read every stream, no other test's."""
    with EmbeddedServer(store_dir=tmp_path_factory.mktemp("console-nats")) as server:
        yield server


@pytest.fixture(scope="module")
def console_settings(
    console_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory
) -> Settings:
    store = tmp_path_factory.mktemp("console-store") / "store.db"
    return load_settings(
        {**TEST_SETTINGS, "nats_url": console_server.url, "store_url": f"sqlite:///{store}"}, env={}
    )


@pytest_asyncio.fixture(scope="module")
async def conn(console_settings: Settings) -> AsyncIterator[Connection]:
    """A connection to the module's server, with the CONTRACT streams provisioned."""
    connection = await connect(console_settings, name="console-test")
    await ensure(connection.js, default_streams(console_settings), [])
    yield connection
    await connection.close()


@pytest.fixture(scope="module")
def console(
    console_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory, conn: Connection
) -> Iterator[ConsoleProcess]:
    """The console with a viewer and an operator token, as an operator deploys it; one
    audit report waits under its ``--reports``."""
    reports = tmp_path_factory.mktemp("reports")
    (reports / "run1" / "report").mkdir(parents=True)
    (reports / "run1" / "report" / "audit.json").write_text(
        '{"ok": true, "generated_at": "2026-11-27T10:00:00Z"}'
    )
    (reports / "run1" / "report" / "audit.html").write_text(
        "<html><body>exactly once, checked</body></html>"
    )
    proc = ConsoleProcess(
        console_server.url,
        tmp_path_factory.mktemp("console"),
        "--reports",
        str(reports),
        env=TOKENS,
    ).start()
    yield proc
    proc.stop()


@pytest_asyncio.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        await chromium.close()


@pytest_asyncio.fixture
async def page(browser: Browser, request: pytest.FixtureRequest) -> AsyncIterator[Page]:
    """A fresh browser context (no cookies); a screenshot is saved when the test fails."""
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15_000)
    tab = await context.new_page()
    try:
        yield tab
    finally:
        report = getattr(request.node, "report_call", None)
        if report is not None and report.failed:
            os.makedirs(SCREENSHOTS, exist_ok=True)
            shot = SCREENSHOTS / f"{request.node.name}.png"
            await tab.screenshot(path=str(shot), full_page=True)
            print(f"screenshot of the failed test: {shot}")
        await context.close()


@pytest.fixture
def doc_shot() -> Callable[[Page, str], Awaitable[None]]:
    """``await doc_shot(page, "name")``: docs/img/console-NAME.png, when
    MESHFORGE_DOC_SCREENSHOTS=1 (so a plain test run leaves the tree as it was)."""

    async def shoot(tab: Page, name: str) -> None:
        if os.environ.get("MESHFORGE_DOC_SCREENSHOTS") == "1":
            DOC_IMAGES.mkdir(parents=True, exist_ok=True)
            await tab.screenshot(path=str(DOC_IMAGES / f"console-{name}.png"), full_page=True)

    return shoot
