"""The console's jobs in a real browser: progress and per-node states of a job rolling out
to a running node, cancel by an operator, no cancel for a viewer or a tenant's console."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator

import pytest
from console_support import (
    OPERATOR_TOKEN,
    TOKENS,
    VIEWER_TOKEN,
    ConsoleProcess,
    node_process,
    sign_in,
)
from playwright.async_api import Page, expect

from meshforge.control.jobs import JobSpec, JobStore
from meshforge.transport.connection import Connection
from meshforge.transport.server import EmbeddedServer
from polling import wait_until

DocShot = Callable[[Page, str], Awaitable[None]]
SITE = "lab2"


@pytest.fixture(scope="module")
def fleet_node(
    console_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """``meshforge node lab2 n1``: the one target of the jobs that is up and answers."""
    with node_process(console_server.url, tmp_path_factory.mktemp("node"), SITE, "n1"):
        yield


async def _job(conn: Connection, *, rate: float | None = None) -> tuple[JobStore, str]:
    """A job of ``echo`` to n1 (up) and n2, n3 (never up), created as ``ctl job create`` does."""
    store = await JobStore.open(conn.js)
    job = f"fw-{uuid.uuid4().hex[:6]}"
    targets = [(SITE, "n1"), (SITE, "n2"), (SITE, "n3")]
    await store.create(JobSpec(job, "echo", {"firmware": 7}, targets=targets, rate=rate))
    return store, job


async def test_an_operator_sees_a_job_progress_and_cancels_it(
    console: ConsoleProcess,
    console_server: EmbeddedServer,
    conn: Connection,
    fleet_node: None,
    page: Page,
    doc_shot: DocShot,
) -> None:
    # One command a minute: n1 gets it at once and answers; n2 and n3 wait their turn.
    store, job = await _job(conn, rate=1)
    controller = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshforge", "ctl", "job", "run", job,
        "--nats-url", console_server.url,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await sign_in(page, console.url, OPERATOR_TOKEN, "nadia")
        await page.goto(f"{console.url}/nodes")
        row = page.locator(f"#job-{job}")  # the nodes page lists the jobs and refreshes them
        await expect(row).to_contain_text("running", timeout=15_000)
        await expect(row.locator(".job-done")).to_have_text("1/3", timeout=30_000)
        await expect(row).to_contain_text("SUCCEEDED 1")
        await expect(row).to_contain_text("QUEUED 2")
        await page.goto(f"{console.url}/jobs")
        await expect(page.locator(f"#job-{job} progress")).to_have_attribute("value", "1")
        await doc_shot(page, "jobs")

        await page.click(f"#job-{job} a")
        await expect(page.locator(f"#jobnode-{SITE}-n1")).to_contain_text("SUCCEEDED")
        await expect(page.locator(f"#jobnode-{SITE}-n2")).to_contain_text("QUEUED")
        await expect(page.locator(f"#jobnode-{SITE}-n1 td.num").first).to_have_text("1")  # attempt
        await expect(page.locator("#job-done")).to_have_text("1/3 done")
        await doc_shot(page, "job")

        await page.click("#cancel-job")
        await expect(page.locator("#confirm-text")).to_contain_text(f"Cancel job {job}")
        await page.click("#confirm")
        await expect(page.locator("#flash")).to_contain_text(f"job {job} canceled")
        # The controller sends nothing more and marks the waiting nodes CANCELED.
        await expect(page.locator("#job-status")).to_have_text("canceled", timeout=20_000)
        await expect(page.locator(f"#jobnode-{SITE}-n2")).to_contain_text("CANCELED")
        await expect(page.locator(f"#jobnode-{SITE}-n3")).to_contain_text("CANCELED")
        await expect(page.locator(f"#jobnode-{SITE}-n1")).to_contain_text("SUCCEEDED")
        await page.reload()
        await expect(page.locator("#cancel-job")).to_have_count(0)
        await wait_until(
            lambda: (
                "nadia (operator via session" in console.log()
                and f"canceled job {job}" in console.log()
            ),
            what="the audit line of the cancel",
        )
        records = await store.nodes(job)
        assert [records[f"{SITE}.{n}"].attempt for n in ("n1", "n2", "n3")] == [1, 0, 0]
        # Not every node SUCCEEDED: `ctl job run` says so with exit 1.
        assert await asyncio.wait_for(controller.wait(), 20) == 1
    finally:
        if controller.returncode is None:
            controller.kill()
            await controller.wait()


async def test_a_viewer_sees_a_job_but_no_cancel_and_a_forged_cancel_is_refused(
    console: ConsoleProcess, conn: Connection, page: Page
) -> None:
    store, job = await _job(conn)
    await sign_in(page, console.url, VIEWER_TOKEN, "vera")
    await page.goto(f"{console.url}/jobs/{job}")
    await expect(page.locator(f"#jobnode-{SITE}-n3")).to_contain_text("QUEUED")
    await expect(page.locator("#job-status")).to_have_text("running")
    await expect(page.locator("#cancel-job")).to_have_count(0)
    forged = await page.request.post(
        f"{console.url}/jobs/{job}/cancel", form={"confirm": "yes", "csrf": "x"}, max_redirects=0
    )
    assert forged.status == 403
    assert not await store.canceled(job)


async def test_an_operator_cancel_without_the_csrf_token_is_refused(
    console: ConsoleProcess, conn: Connection, page: Page
) -> None:
    store, job = await _job(conn)
    await sign_in(page, console.url, OPERATOR_TOKEN, "nadia")
    forged = await page.request.post(
        f"{console.url}/jobs/{job}/cancel", form={"confirm": "yes"}, max_redirects=0
    )
    assert forged.status == 403
    assert not await store.canceled(job)


@pytest.fixture(scope="module")
def tenant_console(
    console_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConsoleProcess]:
    proc = ConsoleProcess(
        console_server.url, tmp_path_factory.mktemp("acme"), "--tenant", "acme", env=TOKENS
    ).start()
    yield proc
    proc.stop()


async def test_a_console_bound_to_a_tenant_shows_no_jobs_and_cancels_none(
    tenant_console: ConsoleProcess, conn: Connection, page: Page
) -> None:
    store, job = await _job(conn)
    await sign_in(page, tenant_console.url, OPERATOR_TOKEN, "tess")
    await expect(page.locator("#nav-jobs")).to_have_count(0)
    for path in ("/jobs", f"/jobs/{job}"):
        await page.goto(f"{tenant_console.url}{path}")
        await expect(page.locator("#error")).to_contain_text("jobs belong to sites, not tenants")
        await expect(page.locator("body")).not_to_contain_text(job)
    refused = await page.request.post(
        f"{tenant_console.url}/jobs/{job}/cancel",
        headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"},
        form={"confirm": "yes"},
        max_redirects=0,
    )
    assert refused.status == 400
    assert not await store.canceled(job)
