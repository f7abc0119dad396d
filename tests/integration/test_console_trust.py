"""The console against hostile input and stolen cookies, with a real nats-server behind it.

No input answers 500; a 500 still carries the security headers; sign-out, idle time and
a restart end a session; sign-in is throttled and CSRF-checked; cross-site POSTs are
refused; a console bound to a tenant lists only that tenant's pipeline reports.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from console_client import Answer, Browser, running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from meshforge.config import Settings, load_settings
from meshforge.console import create_app
from meshforge.console.auth import ConsoleTokens, SignInThrottle
from meshforge.topology.provision import ensure
from meshforge.topology.specs import default_streams
from meshforge.topology.subjects import STREAM_FAILED
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer

EXAMPLES = int(os.environ.get("MESHFORGE_FUZZ_EXAMPLES", "10")) * 20
VIEWER = "viewer-" + uuid.uuid4().hex
OPERATOR = "operator-" + uuid.uuid4().hex
TOKENS = ConsoleTokens(viewer=VIEWER, operator=OPERATOR)
WANTED_HEADERS = (
    "content-security-policy",
    "x-frame-options",
    "x-content-type-options",
    "referrer-policy",
    "cache-control",
)


class Clock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """A server of this module's own: the fuzz test may purge or re-drive what it finds."""
    with EmbeddedServer(store_dir=tmp_path_factory.mktemp("console-nats")) as found:
        yield found


@pytest.fixture(scope="module")
async def base(server: EmbeddedServer) -> Settings:
    settings = load_settings({"nats_url": server.url}, env={})
    conn = await connect(settings, name="console-trust")
    await ensure(conn.js, default_streams(settings), [])
    # One letter of the last hour: the overview's reason count stops at it, not at a timeout.
    await conn.js.publish(
        "failed.cmd.acme.demo.order.create",
        b"{}",
        headers={"Dlq-Reason": "max_deliveries"},
        stream=STREAM_FAILED,
    )
    await conn.close()
    return settings


def _settings(base: Settings, **more: object) -> Settings:
    return load_settings({"nats_url": base.nats_url, **more}, env={})


def _app(base: Settings, reports: Path | None = None, **kwargs: object) -> Starlette:
    settings = _settings(base, **({"tenant": kwargs.pop("tenant")} if "tenant" in kwargs else {}))
    extra = {"reports": reports} if reports is not None else {}
    return create_app(settings, nats_url=str(base.nats_url), tokens=TOKENS, **extra, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
async def app(base: Settings) -> AsyncIterator[Starlette]:
    async with running(_app(base)) as found:
        yield found


def _secured(answer: Answer) -> None:
    missing = [name for name in WANTED_HEADERS if answer.header(name) is None]
    assert not missing, f"answer {answer.status} lacks {missing}"
    assert answer.header("x-content-type-options") == "nosniff"
    assert answer.header("x-frame-options") == "DENY"


async def _operator(app: Starlette, client: str = "10.1.0.1") -> Browser:
    browser = Browser(app, client=(client, 50000))
    signed = await browser.sign_in(OPERATOR, "olga")
    assert signed.status == 303, signed.text
    return browser


# ---- no 500 to input -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ({"start": "²"}, "start"),
        ({"start": "0"}, "start"),
        ({"since": "99999999999999999999"}, "since"),
        ({"since": "9" * 10_000}, "since"),
        ({"since": "0001-01-01T00:00+23:59"}, "since"),
        ({"reason": "nonsense"}, "reason"),
        ({"subject": "x" * 5_000}, "subject"),
    ],
)
async def test_a_bad_query_parameter_answers_400_naming_it(
    app: Starlette, query: dict[str, str], named: str
) -> None:
    answer = await (await _operator(app)).get("/dead-letters", query)
    assert answer.status == 400, answer.text[:300]
    assert f"{named}:" in answer.text
    assert "Traceback" not in answer.text
    _secured(answer)


async def test_a_bad_seq_in_a_form_or_a_path_answers_400(app: Starlette) -> None:
    browser = await _operator(app)
    page = await browser.get("/dead-letters")
    token = page.csrf()
    selected = await browser.post("/dead-letters/redrive", [("csrf", token), ("seq", "²")])
    assert selected.status == 400 and "seq:" in selected.text
    for path in ("/dead-letters/²", "/dead-letters/" + "9" * 5_000, "/pipeline/" + "9" * 5_000):
        answer = await browser.get(path)
        assert answer.status == 400, (path[:40], answer.status)
        _secured(answer)
    one = await browser.post("/dead-letters/99999999999999999999/redrive", {"csrf": token})
    assert one.status == 400 and "id:" in one.text
    sent = await browser.post(
        "/nodes/send",
        {"csrf": token, "target": "lab/n1", "command": "echo", "deadline": "9" * 30},
    )
    assert sent.status == 400 and "deadline" in sent.text


async def test_an_unexpected_error_answers_a_plain_500_with_the_security_headers(
    base: Settings,
) -> None:
    async def boom(request: Request) -> Response:
        raise RuntimeError("a detail only the log may hold")

    built = _app(base)
    built.router.routes.append(Route("/boom", boom))
    async with running(built):
        answer = await Browser(built).get("/boom", authorization=f"Bearer {VIEWER}")
    assert answer.status == 500
    _secured(answer)
    assert "a detail only the log may hold" not in answer.text
    assert "Traceback" not in answer.text
    assert answer.raised is None


_hostile_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["²", "١٢", "0", "1", "-1", "99999999999999999999", "9" * 5000, "", " 5 "]),
    st.text(alphabet="0123456789", min_size=1, max_size=40),
    st.sampled_from(["cmd.>", "cmd.acme.>", ">", "cmd..x", "yes", "2026-11-27T10:00"]),
)
_ROUTES: list[tuple[str, str, tuple[str, ...]]] = [
    # method, path (with {} for hostile path parts), parameter names (query or form)
    ("GET", "/healthz", ()),
    ("GET", "/", ()),
    ("GET", "/nodes", ()),
    ("POST", "/nodes/send", ("target", "command", "payload", "deadline")),
    ("GET", "/nodes/{}/{}/replies/{}", ()),
    ("GET", "/pipeline", ()),
    ("GET", "/pipeline/{}", ()),
    ("GET", "/login", ("next",)),
    ("POST", "/login", ("next", "token", "name")),
    ("POST", "/logout", ()),
    ("GET", "/dead-letters", ("subject", "reason", "start", "since")),
    ("POST", "/dead-letters/redrive", ("seq", "seq")),
    ("POST", "/dead-letters/redrive-all", ("subject",)),
    ("POST", "/dead-letters/purge", ("subject",)),
    ("GET", "/dead-letters/{}", ("original",)),
    ("POST", "/dead-letters/{}/redrive", ()),
    ("GET", "/jobs", ()),
    ("GET", "/jobs/{}", ()),
    ("POST", "/jobs/{}/cancel", ("confirm",)),
    ("GET", "/contract", ()),
    ("GET", "/contract.json", ()),
]
_WHO = ["nobody", "viewer bearer", "operator bearer", "wrong bearer", "session"]
_SITE = [None, "same-origin", "cross-site", "same-site", "none"]
_ORIGIN = [None, "http://127.0.0.1:8222", "https://evil.example", "null"]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    route=st.sampled_from(_ROUTES),
    parts=st.lists(_hostile_text, min_size=3, max_size=3),
    values=st.lists(_hostile_text, min_size=4, max_size=4),
    who=st.sampled_from(_WHO),
    with_csrf=st.booleans(),
    confirm=st.booleans(),
    fetch_site=st.sampled_from(_SITE),
    origin=st.sampled_from(_ORIGIN),
)
async def test_no_route_answers_500_to_any_parameter_and_every_answer_is_secured(
    app: Starlette,
    route: tuple[str, str, tuple[str, ...]],
    parts: list[str],
    values: list[str],
    who: str,
    with_csrf: bool,
    confirm: bool,
    fetch_site: str | None,
    origin: str | None,
) -> None:
    method, template, names = route
    path = template.format(*[p.replace("/", "%2F").replace("?", "%3F") for p in parts])
    browser = Browser(app, client=("10.9.0.1", 1))
    headers: dict[str, str] = {}
    if who == "session":
        browser = await _operator(app, client="10.9.0.2")
    elif who != "nobody":
        token = {"viewer bearer": VIEWER, "operator bearer": OPERATOR}.get(who, "not-a-token")
        headers["authorization"] = f"Bearer {token}"
    if fetch_site:
        headers["sec-fetch-site"] = fetch_site
    if origin:
        headers["origin"] = origin
    pairs = list(zip(names, values, strict=False))
    if method == "GET":
        answer = await browser.get(path, "&".join(f"{k}={v}" for k, v in pairs), **headers)
    else:
        if with_csrf and who == "session":
            pairs.append(("csrf", (await browser.get("/login")).csrf()))
        if confirm:
            pairs.append(("confirm", "yes"))
        answer = await browser.post(path, pairs, **headers)
    assert answer.status != 500 and answer.raised is None, (method, path[:80], answer.text[:300])
    _secured(answer)


# ---- sessions that end ---------------------------------------------------------------


async def test_a_cookie_copied_before_sign_out_reads_nothing_and_acts_on_nothing(
    app: Starlette,
) -> None:
    browser = await _operator(app)
    page = await browser.get("/dead-letters")
    assert page.status == 200
    token = page.csrf()
    stolen = Browser(app, client=("10.66.0.1", 1), cookies=dict(browser.cookies))
    assert (await stolen.get("/dead-letters")).status == 200
    out = await browser.post("/logout", {"csrf": token})
    assert out.status == 303
    for path in ("/", "/dead-letters", "/nodes"):
        assert (await stolen.get(path)).status == 401, path
    acted = await stolen.post("/dead-letters/redrive", [("csrf", token), ("seq", "1")])
    assert acted.status == 401


async def test_a_session_ends_after_its_idle_time_and_after_twelve_hours_however_busy(
    base: Settings,
) -> None:
    clock = Clock()
    built = create_app(
        _settings(base, console_session_idle="30m"),
        nats_url=str(base.nats_url),
        tokens=TOKENS,
        clock=clock,
    )
    async with running(built):
        idle = await _operator(built)
        clock.now += 29 * 60
        assert (await idle.get("/pipeline")).status == 200  # a request restarts the idle time
        clock.now += 29 * 60
        assert (await idle.get("/pipeline")).status == 200
        clock.now += 31 * 60
        assert (await idle.get("/pipeline")).status == 401
        busy = await _operator(built, client="10.1.0.2")
        for _ in range(12 * 3):  # a request every 20 minutes for 12 hours
            assert (await busy.get("/pipeline")).status == 200
            clock.now += 20 * 60
        assert (await busy.get("/pipeline")).status == 401


async def test_a_cookie_of_one_console_process_is_refused_by_the_next(base: Settings) -> None:
    first = _app(base)
    async with running(first):
        browser = await _operator(first)
        assert (await browser.get("/pipeline")).status == 200
    second = _app(base)
    async with running(second):
        again = Browser(second, cookies=dict(browser.cookies))
        assert (await again.get("/pipeline")).status == 401


@pytest.mark.parametrize("https_only", [False, True])
async def test_the_session_cookie_is_http_only_same_site_strict_path_root_and_secure_on_tls(
    base: Settings, https_only: bool
) -> None:
    built = _app(base, https_only=https_only)
    async with running(built):
        browser = Browser(built, scheme="https" if https_only else "http")
        form = await browser.get("/login")
        signed = await browser.post("/login", {"csrf": form.csrf(), "name": "sam", "token": VIEWER})
    assert signed.status == 303
    (cookie,) = signed.all("set-cookie")
    flags = [part.strip().lower() for part in cookie.split(";")]
    assert cookie.startswith("meshforge_console=")
    assert "httponly" in flags and "samesite=strict" in flags and "path=/" in flags
    assert ("secure" in flags) == https_only


# ---- sign-in throttled ---------------------------------------------------------------


async def test_fifty_wrong_tokens_are_slowed_then_refused_and_logged_once_each(
    base: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    throttle = SignInThrottle(first=1.0, longest=300.0, global_limit=1_000, clock=clock)
    built = _app(base, throttle=throttle)
    async with running(built):
        mallory = Browser(built, client=("10.6.6.6", 1))
        form = (await mallory.get("/login")).csrf()
        caplog.set_level(logging.INFO, logger="meshforge.console.audit")
        waits = []
        for attempt in range(50):
            wrong = await mallory.post(
                "/login", {"csrf": form, "token": f"guess-{attempt}", "name": "m"}
            )
            assert wrong.status == 401, attempt
            early = await mallory.post("/login", {"csrf": form, "token": OPERATOR, "name": "m"})
            assert early.status == 429, attempt  # the right token, too soon: not even read
            waits.append(int(early.header("retry-after") or 0))
            clock.now += waits[-1]
        assert waits[:10] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300] and set(waits[10:]) == {300}
        # Another address is not punished for mallory's failures.
        other = await Browser(built, client=("10.7.7.7", 1)).sign_in(OPERATOR, "olga")
        assert other.status == 303
        right = await mallory.post("/login", {"csrf": form, "token": OPERATOR, "name": "m"})
        assert right.status == 303
    refusals = [r for r in caplog.records if "sign-in refused" in r.getMessage()]
    assert len(refusals) == 100  # each refusal once: 50 wrong tokens, 50 throttled tries
    assert all(r.name == "meshforge.console.audit" for r in refusals)
    assert sum("wrong token (50 in a row" in r.getMessage() for r in refusals) == 1
    assert sum("too many wrong tokens" in r.getMessage() for r in refusals) == 50
    assert not any(OPERATOR in r.getMessage() or "guess-" in r.getMessage() for r in caplog.records)


async def test_the_global_cap_stops_every_address_only_once_reached(base: Settings) -> None:
    clock = Clock()
    throttle = SignInThrottle(first=1.0, global_limit=5, window=60.0, clock=clock)
    built = _app(base, throttle=throttle)
    async with running(built):
        mallory = Browser(built, client=("10.6.6.6", 1))
        form = (await mallory.get("/login")).csrf()
        for attempt in range(4):
            wrong = await mallory.post("/login", {"csrf": form, "token": "nope", "name": "m"})
            assert wrong.status == 401
            clock.now += 2**attempt
        assert (await Browser(built, client=("10.7.7.7", 1)).sign_in(VIEWER)).status == 303
        assert (await mallory.post("/login", {"csrf": form, "token": "no"})).status == 401
        capped = await Browser(built, client=("10.8.8.8", 1)).sign_in(VIEWER)
        assert capped.status == 429  # five wrong tokens within the minute: everyone waits
        clock.now += 60
        assert (await Browser(built, client=("10.8.8.8", 1)).sign_in(VIEWER)).status == 303


# ---- CSRF on sign-in, Origin and Sec-Fetch-Site --------------------------------------


async def test_sign_in_needs_the_form_s_csrf_token(app: Starlette) -> None:
    browser = Browser(app, client=("10.2.0.1", 1))
    await browser.get("/login")
    assert (await browser.post("/login", {"token": OPERATOR})).status == 403
    wrong = await browser.post("/login", {"token": OPERATOR, "csrf": "forged"})
    assert wrong.status == 403
    # A cross-site form posts with the attacker's cookie-less browser: no token to match.
    fresh = Browser(app, client=("10.2.0.2", 1))
    assert (await fresh.post("/login", {"token": OPERATOR, "csrf": "x"})).status == 403
    assert (await browser.sign_in(OPERATOR)).status == 303


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 303),
        ({"sec_fetch_site": "same-origin"}, 303),
        ({"origin": "http://127.0.0.1:8222"}, 303),
        ({"sec_fetch_site": "cross-site"}, 403),
        ({"sec_fetch_site": "same-site"}, 403),
        ({"origin": "https://evil.example"}, 403),
        ({"origin": "null"}, 303),  # what no-referrer makes a browser send: the token decides
        ({"origin": "null", "sec_fetch_site": "cross-site"}, 403),
        ({"origin": "https://evil.example", "sec_fetch_site": "same-origin"}, 303),
    ],
)
async def test_posts_from_another_site_are_refused_whatever_the_token(
    app: Starlette, headers: dict[str, str], status: int
) -> None:
    browser = Browser(app, client=("10.3.0.1", 1))
    assert (await browser.sign_in(OPERATOR, **headers)).status == status
    if status == 403:
        assert (await browser.sign_in(OPERATOR)).status == 303
    token = (await browser.get("/dead-letters")).csrf()
    acted = await browser.post("/dead-letters/redrive", {"csrf": token}, **headers)
    # Past the checks, the action itself says no letter was selected (400).
    assert acted.status == (400 if status == 303 else 403), acted.text[:200]


# ---- pipeline reports of a tenant ----------------------------------------------------


def _report(root: Path, name: str, tenant: str | None) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    findings: dict[str, object] = {"ok": True, "generated_at": "then"}
    if tenant is not None:
        findings["tenant"] = tenant
    (folder / "audit.json").write_text(json.dumps(findings))
    (folder / "audit.html").write_text(f"<p>report {name}</p>")


async def test_a_console_bound_to_a_tenant_lists_only_that_tenant_s_reports(
    base: Settings, tmp_path: Path
) -> None:
    _report(tmp_path, "acme-run", "acme")
    _report(tmp_path, "other-run", "other")
    _report(tmp_path, "fleet-run", None)
    async with running(_app(base, tmp_path, tenant="acme")) as acme:
        browser = Browser(acme)
        listed = await browser.get("/pipeline", authorization=f"Bearer {VIEWER}")
        assert "acme-run" in listed.text
        assert "other-run" not in listed.text and "fleet-run" not in listed.text
        first = await browser.get("/pipeline/0", authorization=f"Bearer {VIEWER}")
        assert first.status == 200 and "report acme-run" in first.text
        assert (await browser.get("/pipeline/1", authorization=f"Bearer {VIEWER}")).status == 404
    async with running(_app(base, tmp_path, tenant="nobody")) as empty:
        page = await Browser(empty).get("/pipeline", authorization=f"Bearer {VIEWER}")
        assert "-run" not in page.text
        assert 'id="no-reports"' in page.text and "bound to tenant" in page.text
    async with running(_app(base, tmp_path)) as fleet:
        page = await Browser(fleet).get("/pipeline", authorization=f"Bearer {VIEWER}")
        assert all(name in page.text for name in ("acme-run", "other-run", "fleet-run"))
