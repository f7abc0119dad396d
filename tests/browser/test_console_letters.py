"""The console's dead letters in a real browser: see, re-drive, purge, safely, per role and tenant."""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator

import pytest
from console_support import (
    OPERATOR_TOKEN,
    TOKENS,
    VIEWER_TOKEN,
    ConsoleProcess,
    command_body,
    plant,
    sign_in,
)
from playwright.async_api import Page, expect

from meshforge.config import Settings
from meshforge.deadletters.admin import DeadLetters
from meshforge.deadletters.originals import keep_original
from meshforge.demo import InventoryAgent
from meshforge.publish.publisher import Publisher
from meshforge.testing.live import WorkerHarness
from meshforge.topology.subjects import STREAM_COMMANDS
from meshforge.transport.connection import Connection
from meshforge.transport.server import EmbeddedServer
from polling import wait_until

DocShot = Callable[[Page, str], Awaitable[None]]


async def _exists(conn: Connection, seq: int) -> bool:
    try:
        await DeadLetters(conn.js, Publisher(conn.js)).get(seq)
    except Exception:
        return False
    return True


async def test_an_operator_sees_a_planted_dead_letter_redrives_it_and_the_agent_applies_it(
    console: ConsoleProcess,
    conn: Connection,
    console_settings: Settings,
    page: Page,
    doc_shot: DocShot,
) -> None:
    sku = f"console-{uuid.uuid4().hex[:8]}"
    body, _ = command_body("inventory.create", {"sku": sku, "qty": 5})
    seq = await plant(conn.js, "cmd.default.demo.inventory.create", body)

    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    async with WorkerHarness([InventoryAgent()], console_settings, namespace="demo") as harness:
        await sign_in(page, console.url, OPERATOR_TOKEN, "alice")
        # The overview lists the agent's consumer, its sparkline drawn by the vendored library.
        await expect(page.locator("#consumers")).to_contain_text("inventory")
        await expect(page.locator("#reasons")).to_contain_text("max_deliveries")
        await expect(page.locator("#consumers svg.sparkline path").first).to_be_attached()
        # It refreshes itself (htmx, every 5 s): a new reason shows without a reload.
        await plant(conn.js, f"cmd.default.demo.late{sku}.create", b"{}", reason="rejected")
        await expect(page.locator("#reasons")).to_contain_text("rejected", timeout=15_000)
        await expect(page.locator("#consumers svg.sparkline path").first).to_be_attached()
        assert errors == []  # the policy blocked nothing the page needs
        await doc_shot(page, "overview")

        await page.click("text=Dead letters")
        row = page.locator(f"#letter-{seq}")
        await expect(row).to_contain_text("cmd.default.demo.inventory.create")
        await expect(row).to_contain_text("max_deliveries")
        await doc_shot(page, "dead-letters")
        await row.locator("a").first.click()
        await expect(page.locator("#body")).to_contain_text(sku)
        await doc_shot(page, "dead-letter")
        await page.click("#redrive")
        await expect(page.locator("#flash")).to_contain_text(f"re-drove dead letter {seq}")
        await expect(page.locator(f"#letter-{seq}")).to_have_count(0)

        async def applied() -> bool:
            return any(
                e.payload.get("sku") == sku for e in await harness.events("inventory.created")
            )

        await wait_until(applied, timeout=15, what=f"inventory.created for {sku}")
    assert not await _exists(conn, seq)
    await wait_until(
        lambda: (
            "alice (operator via session" in console.log()
            and f"re-drove dead letter {seq}" in console.log()
        ),
        what="the audit line naming alice",
    )


async def test_a_hostile_body_shows_as_text_and_opens_no_dialog(
    console: ConsoleProcess, conn: Connection, page: Page
) -> None:
    body = b"<script>alert(1)</script>"
    seq = await plant(
        conn.js,
        f"cmd.default.demo.xss{uuid.uuid4().hex[:6]}.create",
        body,
        reason="malformed",
        error='<img src=x onerror="alert(2)">',
    )
    dialogs: list[str] = []
    page.on("dialog", lambda d: dialogs.append(d.message))
    await sign_in(page, console.url, OPERATOR_TOKEN, "mallory-watcher")
    await page.goto(f"{console.url}/dead-letters")
    await expect(page.locator(f"#letter-{seq}")).to_contain_text('<img src=x onerror="alert(2)">')
    await page.goto(f"{console.url}/dead-letters/{seq}")
    await expect(page.locator("#body")).to_have_text("<script>alert(1)</script>")
    await expect(page.locator("#letter-error")).to_contain_text("onerror")
    assert await page.locator("main script, main img").count() == 0
    await page.wait_for_load_state("load")
    assert dialogs == []


async def test_a_binary_body_shows_escaped_and_a_truncated_letter_links_its_whole_original(
    console: ConsoleProcess, conn: Connection, page: Page
) -> None:
    binary = await plant(
        conn.js, f"cmd.default.demo.bin{uuid.uuid4().hex[:6]}.create", bytes(range(256)) * 40
    )
    agent = f"cut{uuid.uuid4().hex[:6]}"
    whole = b'{"type": "x.create", "payload": {"blob": "' + b"z" * 9000 + b'"}}'
    copy = await keep_original(
        Publisher(conn.js),
        f"cmd.default.demo.{agent}.create",
        whole,
        {"Trace": "t1"},
        STREAM_COMMANDS,
        77,
    )
    cut = await plant(
        conn.js,
        f"cmd.default.demo.{agent}.create",
        whole[:100],
        # As the router writes it: the kept original is found from the letter's stream and
        # sequence, and Dlq-Original must name that very copy.
        headers={
            "Dlq-Truncated": "body",
            "Dlq-Original": copy,
            "Dlq-Stream": STREAM_COMMANDS,
            "Dlq-Stream-Seq": "77",
        },
    )
    await sign_in(page, console.url, OPERATOR_TOKEN, "bob")
    await page.goto(f"{console.url}/dead-letters/{binary}")
    await expect(page.get_by_text("10240 bytes, binary; first 4096 shown")).to_be_visible()
    await expect(page.locator("#body")).to_contain_text("\\x00\\x01\\x02")

    await page.goto(f"{console.url}/dead-letters/{cut}")
    await expect(page.locator("#body")).not_to_contain_text("z" * 200)
    await page.click("#show-original")
    await expect(page.get_by_text(f"{len(whole)} bytes, text; first 4096 shown")).to_be_visible()
    await expect(page.locator("#headers")).to_contain_text("Trace")


async def test_the_pipeline_page_links_the_latest_audit_report_under_its_own_policy(
    console: ConsoleProcess, page: Page
) -> None:
    await sign_in(page, console.url, VIEWER_TOKEN, "pia")
    await page.click("text=Pipeline")
    await expect(page.locator("#reports")).to_contain_text("run1")
    await expect(page.locator("#reports")).to_contain_text("held")
    report = await page.request.get(f"{console.url}/pipeline/0")
    assert report.ok and "exactly once, checked" in await report.text()
    assert "script-src" not in report.headers["content-security-policy"]
    assert "default-src 'none'" in report.headers["content-security-policy"]


async def test_a_viewer_sees_but_cannot_act_and_a_forged_post_is_refused(
    console: ConsoleProcess, conn: Connection, page: Page
) -> None:
    seq = await plant(conn.js, f"cmd.default.demo.view{uuid.uuid4().hex[:6]}.create", b"{}")
    await sign_in(page, console.url, VIEWER_TOKEN, "victor")
    await page.goto(f"{console.url}/dead-letters")
    await expect(page.locator(f"#letter-{seq}")).to_be_visible()
    for absent in ("#redrive-selected", "#redrive-all", "#purge", "input[name=seq]"):
        await expect(page.locator(absent)).to_have_count(0)
    await page.goto(f"{console.url}/dead-letters/{seq}")
    await expect(page.locator("#body")).to_be_visible()
    await expect(page.locator("#redrive")).to_have_count(0)

    # Forged: the viewer's own session, a made-up token; and the viewer's bearer token.
    forged = await page.request.post(
        f"{console.url}/dead-letters/{seq}/redrive", form={"csrf": "x"}, max_redirects=0
    )
    assert forged.status == 403
    scripted = await page.request.post(
        f"{console.url}/dead-letters/purge",
        form={"confirm": "yes"},
        headers={"Authorization": f"Bearer {VIEWER_TOKEN}"},
        max_redirects=0,
    )
    assert scripted.status == 403
    assert await _exists(conn, seq)


async def test_an_operator_post_without_the_csrf_token_is_refused(
    console: ConsoleProcess, conn: Connection, page: Page
) -> None:
    seq = await plant(conn.js, f"cmd.default.demo.csrf{uuid.uuid4().hex[:6]}.create", b"{}")
    await sign_in(page, console.url, OPERATOR_TOKEN, "olga")
    refused = await page.request.post(f"{console.url}/dead-letters/{seq}/redrive", max_redirects=0)
    assert refused.status == 403 and "CSRF" in await refused.text()
    assert await _exists(conn, seq)


async def test_purge_confirms_with_the_count_and_redrive_selected_takes_the_checked(
    console: ConsoleProcess, conn: Connection, page: Page, doc_shot: DocShot
) -> None:
    agent = f"purge{uuid.uuid4().hex[:6]}"
    seqs = [await plant(conn.js, f"cmd.default.demo.{agent}.create", b"{}") for _ in range(4)]
    await sign_in(page, console.url, OPERATOR_TOKEN, "petra")
    await page.goto(f"{console.url}/dead-letters?subject=cmd.default.demo.{agent}.>")
    await expect(page.locator("#total")).to_have_text("4")
    await page.check(f"#letter-{seqs[0]} input[name=seq]")
    await page.click("#redrive-selected")
    await expect(page.locator("#flash")).to_contain_text("1 dead letter(s) re-driven")

    await page.goto(f"{console.url}/dead-letters?subject=cmd.default.demo.{agent}.>")
    await page.click("#purge")
    await expect(page.locator("#confirm-count")).to_have_text("3")
    await expect(page.locator("#confirm-text")).to_contain_text(
        f"failed.cmd.default.demo.{agent}.>"
    )
    await doc_shot(page, "purge-confirm")
    await page.click("#confirm")
    await expect(page.locator("#flash")).to_contain_text("purged 3 dead letter(s)")
    letters = DeadLetters(conn.js, Publisher(conn.js))
    assert await letters.count(f"failed.cmd.default.demo.{agent}.>") == 0

    other = f"all{uuid.uuid4().hex[:6]}"
    for _ in range(2):
        await plant(conn.js, f"cmd.default.demo.{other}.create", b"{}")
    await page.goto(f"{console.url}/dead-letters?subject=cmd.default.demo.{other}.>")
    await page.click("#redrive-all")
    await expect(page.locator("#confirm-count")).to_have_text("2")
    await page.click("#confirm")
    await expect(page.locator("#flash")).to_contain_text("2 dead letter(s) re-driven")
    assert await letters.count(f"failed.cmd.default.demo.{other}.>") == 0
    info = await conn.js.stream_info(STREAM_COMMANDS, subjects_filter=f"cmd.default.demo.{other}.>")
    assert sum((info.state.subjects or {}).values()) == 2


@pytest.fixture(scope="module")
def acme_console(
    console_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory, conn: Connection
) -> Iterator[ConsoleProcess]:
    """A console bound to tenant acme."""
    proc = ConsoleProcess(
        console_server.url, tmp_path_factory.mktemp("acme"), "--tenant", "acme", env=TOKENS
    ).start()
    yield proc
    proc.stop()


async def test_a_console_bound_to_a_tenant_never_shows_or_touches_another_tenants_letters(
    acme_console: ConsoleProcess, conn: Connection, page: Page
) -> None:
    mine = await plant(conn.js, "cmd.acme.shop.order.create", b'{"mine": true}')
    theirs = await plant(conn.js, "cmd.globex.shop.order.create", b'{"theirs": true}')
    await sign_in(page, acme_console.url, OPERATOR_TOKEN, "ann")
    await expect(page.locator("#tenant")).to_have_text("tenant acme")
    await expect(page.locator("header nav")).not_to_contain_text("Nodes")
    await expect(page.locator("#streams")).to_have_count(0)  # totals would count other tenants
    await page.goto(f"{acme_console.url}/dead-letters")
    await expect(page.locator(f"#letter-{mine}")).to_be_visible()
    await expect(page.locator(f"#letter-{theirs}")).to_have_count(0)
    await expect(page.locator("#letters")).not_to_contain_text("globex")

    await page.goto(f"{acme_console.url}/dead-letters/{theirs}")
    await expect(page.locator("#error")).to_contain_text(f"no dead letter with id {theirs}")
    await page.goto(f"{acme_console.url}/dead-letters?subject=cmd.globex.>")
    await expect(page.locator("#error")).to_contain_text("tenant 'acme' only")

    await page.goto(f"{acme_console.url}/dead-letters")
    token = await page.locator("input[name=csrf]").first.get_attribute("value")
    refused = await page.request.post(
        f"{acme_console.url}/dead-letters/{theirs}/redrive", form={"csrf": token or ""}
    )
    assert refused.status == 400
    purge = await page.request.post(
        f"{acme_console.url}/dead-letters/purge",
        form={"csrf": token or "", "subject": "", "confirm": "yes"},
    )
    assert purge.ok
    assert await _exists(conn, theirs) and not await _exists(conn, mine)


def test_health_is_open_pages_need_a_token_and_carry_the_security_headers(
    console: ConsoleProcess,
) -> None:
    with urllib.request.urlopen(f"{console.url}/healthz", timeout=10) as health:
        assert health.status == 200
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(f"{console.url}/dead-letters", timeout=10)
    assert denied.value.code == 401
    request = urllib.request.Request(
        f"{console.url}/dead-letters", headers={"Authorization": f"Bearer {VIEWER_TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=10) as ok:
        csp = ok.headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self';" in csp
        assert "unsafe-inline" not in csp and ok.headers["X-Content-Type-Options"] == "nosniff"
        assert VIEWER_TOKEN not in ok.read().decode()
    assert VIEWER_TOKEN not in console.log() and OPERATOR_TOKEN not in console.log()
