"""``meshforge dlq ls / show / redrive / purge``: inspect and re-drive dead letters.

A dead letter's ID is its sequence number in ``MESHFORGE_FAILED`` (the first column of
``dlq ls``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from meshforge.cli.common import NatsUrl, nats_target

if TYPE_CHECKING:
    from meshforge.deadletter import DeadLetter, DeadLetters

T = TypeVar("T")

dlq_app = typer.Typer(
    name="dlq",
    help="Inspect, re-drive and purge dead letters (MESHFORGE_FAILED).",
    no_args_is_help=True,
)

SubjectFilter = Annotated[
    str | None,
    typer.Option(
        "--subject",
        help="Only dead letters on this subject pattern, e.g. 'failed.cmd.*.*.order.>'.",
    ),
]


def register(app: typer.Typer) -> None:
    app.add_typer(dlq_app, name="dlq")


def _run(nats_url: str | None, work: Callable[[DeadLetters], Awaitable[T]]) -> T:
    """Connect, build the admin API and run ``work``; NATS failures become one-line errors."""
    from meshforge.config import load_settings

    settings = load_settings({"nats_url": nats_url})

    async def go(url: str) -> T:
        from meshforge.connection import connect
        from meshforge.deadletter import DeadLetters
        from meshforge.errors import MeshForgeError, one_line
        from meshforge.publisher import Publisher

        async with await connect(settings, url=url, name="meshforge-dlq") as conn:
            try:
                return await work(DeadLetters(conn.js, Publisher(conn.js, settings)))
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
    nats_url: NatsUrl = None,
) -> None:
    """List dead letters, oldest first: id, original subject, reason, error, deliveries."""
    from rich.console import Console
    from rich.table import Table

    async def work(letters: DeadLetters) -> tuple[list[DeadLetter], int]:
        return await letters.list(limit=limit, subject_filter=subject), await letters.count(subject)

    found, total = _run(nats_url, work)
    console = Console()
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
        table.add_row(
            str(letter.seq),
            letter.reason,
            "" if letter.deliveries is None else str(letter.deliveries),
            letter.original_subject,
            _short(letter.error, 100),
            letter.timestamp[5:19].replace("T", " "),
        )
    console.print(table)


@dlq_app.command("show")
def show(
    seq: Annotated[int, typer.Argument(metavar="ID", help="The dead letter's id (from dlq ls).")],
    nats_url: NatsUrl = None,
) -> None:
    """Print one dead letter: its headers, then its body (pretty-printed when it is JSON)."""
    from rich.console import Console
    from rich.syntax import Syntax
    from rich.table import Table

    async def work(letters: DeadLetters) -> DeadLetter:
        return await letters.get(seq)

    letter = _run(nats_url, work)
    console = Console()
    console.print(f"dead letter {letter.seq} on {letter.subject}")
    table = Table(show_header=True)
    table.add_column("Header")
    table.add_column("Value", overflow="fold")
    for name, value in letter.headers.items():
        table.add_row(name, value)
    console.print(table)
    try:
        body = json.dumps(json.loads(letter.data), indent=2, ensure_ascii=False)
    except (ValueError, UnicodeDecodeError):
        console.print(f"body ({len(letter.data)} bytes, not JSON):")
        console.print(repr(letter.data), markup=False)
        return
    console.print("body:")
    console.print(Syntax(body, "json", word_wrap=True))


@dlq_app.command("redrive")
def redrive(
    ids: Annotated[
        list[int] | None, typer.Argument(metavar="[ID]...", help="Dead letters to re-drive.")
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="Re-drive every dead letter.")] = False,
    subject: SubjectFilter = None,
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

    count = _run(nats_url, work)
    typer.echo(f"{count} dead letter(s) re-driven")


@dlq_app.command("purge")
def purge(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    subject: SubjectFilter = None,
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

    count = _run(nats_url, work)
    typer.echo(f"purged {count} dead letter(s)")
