"""``meshforge dlq ls / show / redrive / purge``: inspect and re-drive dead letters.

A dead letter's ID is its sequence number in ``MESHFORGE_FAILED`` (the first column of
``dlq ls``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.text import Text

from meshforge.cli.common import NatsUrl, nats_target
from meshforge.deadletters.show import (
    SHOW_BYTES,
    SHOW_HEADER_VALUE,
    SHOW_HEADERS,
    pretty_json,
    printable,
    text_of,
)

if TYPE_CHECKING:
    from meshforge.deadletters.admin import DeadLetters
    from meshforge.deadletters.originals import Original
    from meshforge.deadletters.route import DeadLetter

T = TypeVar("T")

dlq_app = typer.Typer(
    name="dlq",
    help="Inspect, re-drive and purge dead letters (MESHFORGE_FAILED).",
    no_args_is_help=True,
)


def _dead_letter_pattern(value: str | None) -> str | None:
    """Dead letters live under ``failed.``: an original subject's pattern is taken as theirs."""
    if value is None:
        return None
    from meshforge.errors import InvalidSubject
    from meshforge.topology.subjects import DEAD_LETTER_PREFIX, validate_subject

    pattern = value if value.startswith(DEAD_LETTER_PREFIX) else DEAD_LETTER_PREFIX + value
    try:
        validate_subject(pattern, wildcards=True)
    except InvalidSubject as exc:
        raise typer.BadParameter(str(exc)) from None
    return pattern


SubjectFilter = Annotated[
    str | None,
    typer.Option(
        "--subject",
        callback=_dead_letter_pattern,
        help="Only dead letters of this subject pattern, e.g. 'cmd.*.*.order.>' (the"
        " 'failed.' in front may be left out).",
    ),
]


Tenant = Annotated[
    str | None,
    typer.Option(
        "--tenant",
        help="Bind to one tenant: read, re-drive and purge only its dead letters"
        " (failed.cmd.TENANT.>), whatever a letter's headers say.",
    ),
]


def register(app: typer.Typer) -> None:
    app.add_typer(dlq_app, name="dlq")


def _run(
    nats_url: str | None,
    work: Callable[[DeadLetters], Awaitable[T]],
    tenant: str | None = None,
) -> T:
    """Connect, build the admin API and run ``work``; NATS failures become one-line errors."""
    from meshforge.config import load_settings
    from meshforge.topology.subjects import validate_token

    settings = load_settings({"nats_url": nats_url})
    if tenant is not None:
        validate_token(tenant, "tenant")

    async def go(url: str) -> T:
        from meshforge.deadletters.admin import DeadLetters
        from meshforge.errors import MeshForgeError, one_line
        from meshforge.publish.publisher import Publisher
        from meshforge.transport.connection import connect

        async with await connect(settings, url=url, name="meshforge-dlq") as conn:
            try:
                publisher = Publisher(conn.js, settings)
                return await work(DeadLetters(conn.js, publisher, tenant=tenant))
            except MeshForgeError:
                raise
            except Exception as exc:  # nats-py errors: one line, not a traceback
                raise MeshForgeError(f"dead letters: {one_line(exc, 300)}") from None

    with nats_target(settings.nats_url) as url:
        return asyncio.run(go(url))


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


@dlq_app.command("ls")
def ls(
    limit: Annotated[int, typer.Option("--limit", min=1, help="Show at most this many.")] = 100,
    subject: SubjectFilter = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print a JSON array of {id, subject, reason, error, deliveries, time, truncated}.",
        ),
    ] = False,
    tenant: Tenant = None,
    nats_url: NatsUrl = None,
) -> None:
    """List dead letters, oldest first: id, original subject, reason, error, deliveries.

    A reason marked "(cut)" is a truncated dead letter: `dlq show ID --original` shows it whole.
    """
    from rich.table import Table

    from meshforge.cli.common import console as new_console

    async def work(letters: DeadLetters) -> tuple[list[DeadLetter], int] | None:
        from meshforge.errors import MissingTopology

        try:
            found = await letters.list(limit=limit, subject_filter=subject)
            return found, await letters.count(subject)
        except MissingTopology:
            return None  # nothing provisioned yet, so nothing was dead-lettered either

    listed = _run(nats_url, work, tenant)
    if as_json:
        typer.echo(json.dumps([_json_row(x) for x in (listed[0] if listed else [])], indent=2))
        return
    console = new_console()
    if listed is None:
        console.print(
            "no dead letters (there is no MESHFORGE_FAILED stream yet: "
            "`meshforge provision` creates it, as does any agent at start-up)"
        )
        return
    found, total = listed
    if not found:
        console.print("no dead letters")
        return
    table = Table(title=f"dead letters ({len(found)} of {total}); `dlq show ID` for the rest")
    # Short columns stay whole; subject and error fold so a narrow terminal still shows both.
    table.add_column("ID", no_wrap=True, justify="right")
    table.add_column("Reason", no_wrap=True)
    table.add_column("Del.", no_wrap=True, justify="right")
    table.add_column("Original subject", overflow="fold", ratio=1, min_width=12)
    table.add_column("Error", overflow="fold", ratio=2, min_width=14)
    table.add_column("When (UTC)", no_wrap=True)
    for letter in found:
        # Text, not markup: a header's "[" must not be read as a style.
        table.add_row(
            str(letter.seq),
            Text(printable(_short(letter.reason, 20)) + (" (cut)" if letter.truncated else "")),
            "" if letter.deliveries is None else str(letter.deliveries),
            Text(printable(letter.original_subject)),
            Text(printable(_short(letter.error, 100))),
            Text(printable(letter.timestamp[5:19].replace("T", " "))),
        )
    console.print(table)


def _json_row(letter: DeadLetter) -> dict[str, Any]:
    """One dead letter as ``dlq ls --json`` prints it (ASCII JSON: nothing drives a terminal)."""
    stored = letter.stored_at.isoformat() if letter.stored_at else None
    return {
        "id": letter.seq,
        "subject": letter.original_subject,
        "reason": letter.reason,
        "error": letter.error,
        "deliveries": letter.deliveries,
        "time": letter.timestamp or stored,
        "truncated": bool(letter.truncated),
    }


@dlq_app.command("show")
def show(
    seq: Annotated[int, typer.Argument(metavar="ID", help="The dead letter's id (from dlq ls).")],
    original: Annotated[
        bool,
        typer.Option(
            "--original", help="Show the whole original of a truncated dead letter instead."
        ),
    ] = False,
    max_bytes: Annotated[
        int, typer.Option("--max-bytes", min=0, help="Print at most this many bytes of the body.")
    ] = SHOW_BYTES,
    body_file: Annotated[
        Path | None,
        typer.Option("--body-file", help="Also write the whole body, as stored, to this file."),
    ] = None,
    tenant: Tenant = None,
    nats_url: NatsUrl = None,
) -> None:
    """Print one dead letter: its headers, then its body (pretty-printed when it is JSON).

    Any body prints: binary as escaped bytes, a long one cut at --max-bytes (saying so).
    """
    from meshforge.cli.common import console as new_console

    async def work(letters: DeadLetters) -> tuple[DeadLetter, Original | None]:
        letter = await letters.get(seq)
        return letter, (await letters.original(letter) if original else None)

    letter, whole = _run(nats_url, work, tenant)
    console = new_console()
    if whole is None:
        console.print(Text(f"dead letter {letter.seq} on {letter.subject}"))
        headers, data = letter.headers, letter.data
        if letter.truncated:
            console.print(
                Text(f"truncated ({letter.truncated}): `dlq show {seq} --original` shows it whole")
            )
    else:
        console.print(Text(f"original of dead letter {letter.seq}, on {whole.subject}"))
        headers, data = whole.headers, whole.data
    console.print(_header_table(headers))
    for line in _body_lines(data, max_bytes):
        console.print(line)
    if body_file is not None:
        body_file.write_bytes(data)
        console.print(Text(f"body written to {body_file} ({len(data)} bytes)"))


def _header_table(headers: dict[str, str]) -> Any:
    from rich.table import Table

    table = Table(show_header=True)
    table.add_column("Header")
    table.add_column("Value", overflow="fold")
    for index, (name, value) in enumerate(headers.items()):
        if index == SHOW_HEADERS:
            table.add_row(Text("..."), Text(f"{len(headers) - index} more headers not shown"))
            break
        shown = printable(value[:SHOW_HEADER_VALUE])
        if len(value) > SHOW_HEADER_VALUE:
            shown += f"... ({len(value)} characters in all)"
        table.add_row(Text(printable(name[:SHOW_HEADER_VALUE])), Text(shown))
    return table


def _body_lines(data: bytes, max_bytes: int) -> list[Any]:
    """What ``show`` prints of a body: a title line, then the body or its first ``max_bytes``."""
    from rich.syntax import Syntax

    size = len(data)
    cut = size > max_bytes
    part = data[:max_bytes]
    text = text_of(part, final=not cut)
    if not cut and text is not None:
        pretty = pretty_json(text, max_bytes)
        if pretty is not None:
            return [Text("body:"), Syntax(pretty, "json", word_wrap=True)]
    kind = "text" if text is not None else "binary"
    title = f"body ({size} bytes, {kind}"
    title += f"; first {len(part)} shown, --max-bytes or --body-file for all):" if cut else "):"
    shown = printable(text) if text is not None else repr(part)
    return [Text(title), Text(shown)]


@dlq_app.command("redrive")
def redrive(
    ids: Annotated[
        list[int] | None, typer.Argument(metavar="[ID]...", help="Dead letters to re-drive.")
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="Re-drive every dead letter.")] = False,
    subject: SubjectFilter = None,
    tenant: Tenant = None,
    nats_url: NatsUrl = None,
) -> None:
    """Publish dead letters again to their original subjects; each is removed after its PubAck."""
    from meshforge.errors import MeshForgeError

    if bool(ids) == all_:
        raise MeshForgeError("dlq redrive: give dead-letter ids or --all (not both)")
    if subject and not all_:
        raise MeshForgeError("dlq redrive: --subject only goes with --all")

    async def work(letters: DeadLetters) -> int:
        if all_:
            done = await letters.redrive_all(subject)
            for seq, result in done:
                typer.echo(f"re-drove {seq} -> {result.stream} seq={result.seq}")
            return len(done)
        for seq in ids or []:
            result = await letters.redrive(seq)
            typer.echo(f"re-drove {seq} -> {result.stream} seq={result.seq}")
        return len(ids or [])

    count = _run(nats_url, work, tenant)
    typer.echo(f"{count} dead letter(s) re-driven")


@dlq_app.command("purge")
def purge(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    subject: SubjectFilter = None,
    tenant: Tenant = None,
    nats_url: NatsUrl = None,
) -> None:
    """Delete every dead letter (or those matching --subject) for good."""
    from meshforge.errors import MeshForgeError

    if not yes:
        what = f"dead letters on {subject}" if subject else "ALL dead letters"
        if not typer.confirm(f"Delete {what} for good?", default=False):
            raise MeshForgeError("dlq purge: not confirmed (use --yes to skip the question)")

    async def work(letters: DeadLetters) -> int:
        return await letters.purge(subject)

    count = _run(nats_url, work, tenant)
    typer.echo(f"purged {count} dead letter(s)")
