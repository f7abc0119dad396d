"""``meshforge events tail [SUBJECT]``: watch the events that came out, like ``tail -f``.

It starts with the last ``--last`` stored events (or those since ``--since``, or all of
them with ``--all``) and then waits for new ones until Ctrl-C, ``--count`` events, or,
with ``--no-follow``, the end of what is stored. Reading never consumes anything: an
ordered consumer of the server's own, gone when the command ends.

Example::

    meshforge events tail                                   # evt.>, pretty, follows
    meshforge events tail 'evt.default.demo.order.>' --since 5m --no-follow --json
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer

from meshforge.cli.common import NatsUrl, nats_target

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from nats.js.api import ConsumerConfig

events_app = typer.Typer(
    name="events", help="Watch events (or any stored subject) as they come.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    app.add_typer(events_app, name="events")


@dataclass(frozen=True, slots=True)
class Start:
    """Where reading starts: a sequence (with how many to skip first), a time, or the first."""

    seq: int | None = None
    time: datetime | None = None
    skip: int = 0


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """``--since``: a duration back from now (``90s``, ``5m``, ``2h``) or an RFC 3339 time."""
    from meshforge.config import parse_duration
    from meshforge.errors import ConfigError

    try:
        return (now or datetime.now(UTC)) - timedelta(seconds=parse_duration(value, "--since"))
    except ConfigError:
        pass
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(
            f"expected a duration (30s, 5m, 2h) or an RFC 3339 time, got {value!r}",
            param_hint="--since",
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


@events_app.command("tail")
def tail(
    subject: Annotated[
        str, typer.Argument(help="Subject or pattern, e.g. 'evt.default.demo.order.>'.")
    ] = "evt.>",
    last: Annotated[
        int, typer.Option("--last", "-n", min=0, help="Start with this many stored ones.")
    ] = 10,
    since: Annotated[
        str | None,
        typer.Option("--since", help="Start at this time instead: 5m (ago) or RFC 3339."),
    ] = None,
    everything: Annotated[bool, typer.Option("--all", help="Start at the first stored.")] = False,
    count: Annotated[
        int | None, typer.Option("--count", min=1, help="Stop after this many.")
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow/--no-follow", help="Wait for new ones (like tail -f).")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object a line.")] = False,
    nats_url: NatsUrl = None,
) -> None:
    """Print stored events, then new ones as they come (Ctrl-C stops)."""
    from meshforge.config import load_settings
    from meshforge.errors import InvalidSubject
    from meshforge.topology.subjects import validate_subject

    try:
        validate_subject(subject, wildcards=True)
    except InvalidSubject as exc:
        raise typer.BadParameter(str(exc), param_hint="SUBJECT") from None
    start = Start(time=parse_since(since)) if since else Start(seq=1) if everything else None
    settings = load_settings({"nats_url": nats_url})
    with nats_target(settings.nats_url) as url, contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_tail(url, subject, start, last, count, follow, as_json))


async def _tail(
    url: str,
    subject: str,
    start: Start | None,
    last: int,
    count: int | None,
    follow: bool,
    as_json: bool,
) -> None:
    from nats.errors import Error as NatsError
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import NotFoundError

    from meshforge.config import load_settings
    from meshforge.errors import MeshForgeError, one_line
    from meshforge.topology.specs import policy_name
    from meshforge.transport.connection import connect

    async with await connect(load_settings({}), url=url, name="meshforge-events") as conn:
        try:
            stream = await conn.js.find_stream_name_by_subject(subject)
        except NotFoundError:
            raise MeshForgeError(
                f"no stream stores {subject!r} (yet): `meshforge provision` creates "
                "MeshForge's streams"
            ) from None
        try:
            info = await conn.js.stream_info(stream)
            if policy_name(info.config.retention) == "workqueue":
                raise MeshForgeError(
                    f"{subject!r} is stored in {stream}, a work queue: a message leaves it once "
                    "handled; watch what came out instead (evt.>, or failed.> for dead letters)"
                )
            if start is None:
                start = await _last(conn.js, stream, subject, last)
            pending = await _pending(conn.js, stream, subject, _config(start, subject))
            if not follow and pending <= start.skip:
                return
            sub = await conn.js.subscribe(
                subject, stream=stream, ordered_consumer=True, config=_config(start, subject)
            )
        except NatsError as exc:
            raise MeshForgeError(f"events tail {subject}: {one_line(exc, 300)}") from None
        shown, skip = 0, start.skip
        try:
            while count is None or shown < count:
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except (TimeoutError, NatsTimeout):
                    continue
                if skip:
                    skip -= 1
                else:
                    typer.echo(render(msg, as_json))
                    shown += 1
                if not follow and msg.metadata.num_pending == 0:
                    return
        finally:
            await sub.unsubscribe()


def _config(start: Start, subject: str) -> ConsumerConfig:
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    if start.time is not None:
        return ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=start.time,
            filter_subject=subject,
            ack_policy=AckPolicy.NONE,
        )
    return ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=max(1, start.seq or 1),
        filter_subject=subject,
        ack_policy=AckPolicy.NONE,
    )


async def _pending(js: JetStreamContext, stream: str, subject: str, config: ConsumerConfig) -> int:
    """How many stored messages of ``subject`` a consumer starting as ``config`` would get."""
    config.inactive_threshold = 30.0  # a probe left behind by a crash goes away on its own
    config.mem_storage = True
    info = await js.add_consumer(stream, config)
    try:
        return int(info.num_pending or 0)
    finally:
        with contextlib.suppress(Exception):
            await js.delete_consumer(stream, info.name)


async def _last(js: JetStreamContext, stream: str, subject: str, n: int) -> Start:
    """The start of the last ``n`` stored messages of ``subject``: look back ever further."""
    state = (await js.stream_info(stream)).state
    if n == 0:
        return Start(seq=state.last_seq + 1)
    span = n
    while True:
        seq = max(state.first_seq, state.last_seq - span + 1)
        found = await _pending(js, stream, subject, _config(Start(seq=seq), subject))
        if found >= n or seq <= state.first_seq:
            return Start(seq=seq, skip=max(0, found - n))
        span *= 8


def render(msg: Msg, as_json: bool) -> str:
    """One line for one stored message: pretty (time, seq, subject, type, payload) or JSON."""
    from meshforge.deadletters.show import printable
    from meshforge.transport.headers import text_headers

    meta = msg.metadata
    stamp = meta.timestamp.astimezone(UTC)
    body = _body(msg.data)
    if as_json:
        row = {
            "stream": meta.stream,
            "seq": meta.sequence.stream,
            "subject": msg.subject,
            "time": stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "headers": text_headers(msg.headers),
            "body": body,
        }
        line = json.dumps(row, ensure_ascii=False)
        # A character that drives a terminal (bidi, C1) is sent as a JSON escape instead.
        return line if line.isprintable() else json.dumps(row)
    head = f"{stamp:%H:%M:%S.%f}"[:-3] + f" #{meta.sequence.stream} {msg.subject}"
    if isinstance(body, dict) and isinstance(body.get("payload"), dict):
        cause = f" causation={body['causation_id']}" if body.get("causation_id") else ""
        payload = json.dumps(body["payload"], ensure_ascii=False, separators=(", ", ": "))
        return printable(f"{head} {body.get('type')} id={body.get('id')}{cause} {payload}")
    shown = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
    return printable(f"{head} (not an envelope) {shown[:200]}")


def _body(data: bytes) -> Any:
    """The body as JSON when it is, else as text (bytes that are not UTF-8 escaped)."""
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", errors="backslashreplace")
