"""The dead letters pages: list (paged by stream sequence), one letter, re-drive and purge.

Every action calls ``DeadLetters``, the code behind ``meshforge dlq``. A console bound to
a tenant reads and acts on ``failed.cmd.<tenant>.>`` only: the subject is the authority.
"""

from __future__ import annotations

from typing import Any

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from meshforge.console import params
from meshforge.console.auth import User, audit
from meshforge.console.status import scope_filter
from meshforge.console.web import Console, action, console_of, flash, page, render, see_other
from meshforge.deadletters.route import REASONS, DeadLetter
from meshforge.deadletters.show import (
    SHOW_BYTES,
    SHOW_HEADER_VALUE,
    SHOW_HEADERS,
    pretty_json,
    printable,
    text_of,
)
from meshforge.errors import MeshForgeError
from meshforge.topology.subjects import DEAD_LETTER_PREFIX, matches, validate_subject

__all__ = ["routes"]

PAGE_SIZE = 50


def dead_letter_filter(console: Console, subject: str | None) -> str | None:
    """The ``failed.`` pattern for an original-subject pattern, inside the console's tenant."""
    subject = params.text(subject, "subject", limit=255).removeprefix(DEAD_LETTER_PREFIX)
    scope = scope_filter(console.tenant)
    if not subject:
        return DEAD_LETTER_PREFIX + scope if scope else None
    pattern = validate_subject(DEAD_LETTER_PREFIX + subject, wildcards=True)
    tokens = subject.split(".")
    if scope and (len(tokens) < 3 or tokens[:2] != ["cmd", console.tenant]):
        raise MeshForgeError(
            f"this console sees tenant {console.tenant!r} only: a subject pattern must start "
            f"with cmd.{console.tenant}."
        )
    return pattern


async def _letter(console: Console, seq: int) -> DeadLetter:
    """Dead letter ``seq``, if this console may see it (another tenant's looks absent)."""
    letter = await console.letters().get(seq)
    scope = scope_filter(console.tenant)
    if scope and not matches(DEAD_LETTER_PREFIX + scope, letter.subject):
        raise MeshForgeError(f"no dead letter with id {seq} in {console.letters().stream}")
    return letter


@page
async def list_page(request: Request) -> Response:
    console = console_of(request)
    q = request.query_params
    subject, reason = q.get("subject", ""), params.choice(q.get("reason"), "reason", REASONS)
    pattern = dead_letter_filter(console, subject)
    start = params.number(q.get("start"), "start", default=1, low=1)
    since = params.since(q.get("since"))
    letters = console.letters()
    found, next_seq = await letters.page(
        start=start,
        limit=PAGE_SIZE,
        subject_filter=pattern,
        reason=reason or None,
        since=since,
    )
    total = await letters.count(pattern)
    context = {
        "letters": found,
        "next_seq": next_seq,
        "start": start,
        "total": total,
        "subject": subject,
        "reason": reason,
        "since": q.get("since", ""),
        "reasons": REASONS,
        "pattern": pattern or "failed.>",
    }
    return render(request, "letters.html", context)


def _headers(headers: dict[str, str]) -> tuple[list[tuple[str, str]], int]:
    shown = []
    for name, value in list(headers.items())[:SHOW_HEADERS]:
        text = printable(value[:SHOW_HEADER_VALUE])
        if len(value) > SHOW_HEADER_VALUE:
            text += f"... ({len(value)} characters in all)"
        shown.append((printable(name[:SHOW_HEADER_VALUE]), text))
    return shown, max(0, len(headers) - SHOW_HEADERS)


def _body(data: bytes) -> dict[str, Any]:
    """The body as the page shows it: pretty JSON, text, or escaped bytes, cut at SHOW_BYTES."""
    cut = len(data) > SHOW_BYTES
    part = data[:SHOW_BYTES]
    text = text_of(part, final=not cut)
    pretty = pretty_json(text, SHOW_BYTES) if text is not None and not cut else None
    shown = pretty or (printable(text) if text is not None else repr(part))
    kind = "JSON" if pretty else ("text" if text is not None else "binary")
    return {"text": shown, "kind": kind, "size": len(data), "cut": cut, "shown": len(part)}


@page
async def letter_page(request: Request) -> Response:
    console = console_of(request)
    seq = params.number(request.path_params["seq"], "id", low=1)
    letter = await _letter(console, seq)
    whole = request.query_params.get("original") == "1" and bool(letter.truncated)
    if whole:
        original = await console.letters().original(letter)
        headers, data, subject = original.headers, original.data, original.subject
    else:
        headers, data, subject = letter.headers, letter.data, letter.subject
    shown, more = _headers(headers)
    context = {
        "letter": letter,
        "whole": whole,
        "subject": subject,
        "headers": shown,
        "more_headers": more,
        "body": _body(data),
    }
    return render(request, "letter.html", context)


@action
async def redrive_one(request: Request, user: User, form: FormData) -> Response:
    console = console_of(request)
    seq = params.number(request.path_params["seq"], "id", low=1)
    await _letter(console, seq)
    result = await console.letters().redrive(seq)
    audit(user, f"re-drove dead letter {seq} -> {result.stream} seq={result.seq}")
    flash(request, f"re-drove dead letter {seq} -> {result.stream} seq={result.seq}")
    return see_other("/dead-letters")


@action
async def redrive_selected(request: Request, user: User, form: FormData) -> Response:
    console = console_of(request)
    seqs = params.numbers([v for v in form.getlist("seq") if isinstance(v, str)], "seq")
    if not seqs:
        raise MeshForgeError("re-drive: no dead letter selected")
    for seq in seqs:
        await _letter(console, seq)
    done = []
    for seq in seqs:
        result = await console.letters().redrive(seq)
        done.append(f"{seq} -> {result.stream} seq={result.seq}")
    audit(user, f"re-drove {len(done)} dead letter(s): {', '.join(done)}")
    flash(request, f"{len(done)} dead letter(s) re-driven")
    return see_other("/dead-letters")


def _form_text(form: FormData, name: str) -> str:
    value = form.get(name)
    return value if isinstance(value, str) else ""


async def _confirm_or(
    request: Request, form: FormData, what: str, target: str
) -> tuple[str | None, Response | None]:
    """The pattern to act on; first a page that states the count and asks to confirm."""
    console = console_of(request)
    subject = _form_text(form, "subject")
    pattern = dead_letter_filter(console, subject)
    if _form_text(form, "confirm") == "yes":
        return pattern, None
    count = await console.letters().count(pattern)
    context = {
        "what": what,
        "count": count,
        "pattern": pattern or "failed.>",
        "target": target,
        "fields": {"subject": subject, "confirm": "yes"},
    }
    return pattern, render(request, "confirm.html", context)


@action
async def redrive_all(request: Request, user: User, form: FormData) -> Response:
    pattern, confirm = await _confirm_or(request, form, "Re-drive", "/dead-letters/redrive-all")
    if confirm is not None:
        return confirm
    done = await console_of(request).letters().redrive_all(pattern)
    audit(user, f"re-drove all {len(done)} dead letter(s) on {pattern or 'failed.>'}")
    flash(request, f"{len(done)} dead letter(s) re-driven")
    return see_other("/dead-letters")


@action
async def purge(request: Request, user: User, form: FormData) -> Response:
    pattern, confirm = await _confirm_or(request, form, "Purge", "/dead-letters/purge")
    if confirm is not None:
        return confirm
    count = await console_of(request).letters().purge(pattern)
    audit(user, f"purged {count} dead letter(s) on {pattern or 'failed.>'}")
    flash(request, f"purged {count} dead letter(s)")
    return see_other("/dead-letters")


routes = [
    Route("/dead-letters", list_page),
    Route("/dead-letters/redrive", redrive_selected, methods=["POST"]),
    Route("/dead-letters/redrive-all", redrive_all, methods=["POST"]),
    Route("/dead-letters/purge", purge, methods=["POST"]),
    Route("/dead-letters/{seq}", letter_page),
    Route("/dead-letters/{seq}/redrive", redrive_one, methods=["POST"]),
]
