"""``meshforge publish SUBJECT JSON``: publish one command or event as an envelope.

JSON is the payload (``{"sku": "A-1"}``) or a whole envelope (an object with ``type``
and ``payload``). For a payload alone on ``cmd.<tenant>.<ns>.<agent>.<command>`` or
``evt.<tenant>.<ns>.<agent>.<event>`` the type is ``<agent>.<command>`` and the tenant
the subject's. With ``partitions`` set (``MESHFORGE_PARTITIONS``) a five-token command
subject gets its partition token, by the envelope's ``resource_id`` (else its ``id``).
Prints ``stream=... seq=... id=... duplicate=true|false`` (and ``subject=...`` when partitioned).

``--agent MODULE:AGENT`` checks the payload against the type the agent's command declares
(``Command[P]``) before anything is sent: a payload that does not fit is refused with one
line naming the field and the expected type (exit 2), as the worker would dead-letter it.

``--raw BYTES`` (or ``--raw @FILE``) sends a body exactly as given, with no envelope and
no headers: the way to make a malformed command on purpose, or to test another client.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import TYPE_CHECKING, Annotated, Any

import typer

from meshforge.cli.common import NatsUrl, nats_target
from meshforge.errors import ConfigError, InvalidSubject, MalformedMessage

if TYPE_CHECKING:
    from meshforge.config import Settings
    from meshforge.envelope import Envelope
    from meshforge.publish.publisher import PublishResult


def register(app: typer.Typer) -> None:
    app.command("publish")(publish)


def publish(
    subject: Annotated[str, typer.Argument(help="e.g. cmd.default.demo.order.create")],
    body: Annotated[
        str | None,
        typer.Argument(metavar="[JSON]", help="The payload object, or a whole envelope."),
    ] = None,
    raw: Annotated[
        str | None,
        typer.Option(
            "--raw",
            metavar="BYTES|@FILE",
            help="Send this body as is (no envelope, no headers), or a file's bytes with @FILE.",
        ),
    ] = None,
    key: Annotated[
        str | None,
        typer.Option("--key", help="Idempotency key: a request re-sent with it is applied once."),
    ] = None,
    source: Annotated[str, typer.Option("--source", help="Who produced the message.")] = "cli",
    agent: Annotated[
        str | None,
        typer.Option(
            "--agent",
            metavar="MODULE:AGENT",
            help="Check the payload against the type this agent's command declares first.",
        ),
    ] = None,
    nats_url: NatsUrl = None,
) -> None:
    """Publish one command or event as an envelope (or any body as is, with --raw)."""
    from meshforge.config import load_settings
    from meshforge.topology.subjects import validate_subject

    try:
        validate_subject(subject)
    except InvalidSubject as exc:
        raise typer.BadParameter(str(exc), param_hint="SUBJECT") from None
    settings = load_settings({"nats_url": nats_url})
    if raw is not None:
        if body is not None:
            raise typer.BadParameter("give a JSON argument or --raw, not both", param_hint="JSON")
        if key is not None:
            raise typer.BadParameter("--raw sends no headers, so it takes no --key")
        if agent is not None:
            raise typer.BadParameter("--raw sends a body as is, so it takes no --agent")
        data = raw_body(raw)
        with nats_target(settings.nats_url) as url:
            result = asyncio.run(_publish(url, settings, subject, data))
        typer.echo(f"stream={result.stream} seq={result.seq} bytes={len(data)}")
        return
    if body is None:
        raise typer.BadParameter("give the body: a JSON argument, or --raw BYTES|@FILE")
    try:
        env = build_envelope(subject, body, key=key, source=source)
    except MalformedMessage as exc:
        raise typer.BadParameter(str(exc), param_hint="JSON") from None
    if agent is not None:
        check_payload(agent, subject, env)
    from meshforge.topology.partitions import partitioned

    subject = partitioned(subject, env, settings)
    with nats_target(settings.nats_url) as url:
        result = asyncio.run(_publish(url, settings, subject, env))
    shown = f" subject={subject}" if settings.partitions else ""
    typer.echo(
        f"stream={result.stream} seq={result.seq} id={env.id} "
        f"duplicate={'true' if result.duplicate else 'false'}{shown}"
    )


def check_payload(spec: str, subject: str, env: Envelope) -> None:
    """Refuse (``ConfigError``: one line, exit 2) a command that agent ``spec`` would
    dead-letter as ``invalid_payload``: its payload is decoded exactly as the worker
    decodes it, into the type the command declares. A command declared without a type
    (a plain dict) passes; a subject or type that is not one of the agent's commands does not.
    """
    from meshforge.errors import InvalidPayload
    from meshforge.runtime import payloads
    from meshforge.runtime.worker import import_from_cwd, load_agent

    import_from_cwd()
    agent = load_agent(spec)
    tokens = subject.split(".")
    named, _, command = env.type.partition(".")
    if tokens[0] != "cmd" or len(tokens) < 5 or tokens[3] != agent.name or named != agent.name:
        raise ConfigError(
            f"--agent {spec}: {subject!r} (type {env.type!r}) is not a command of agent "
            f"{agent.name!r}: send it on cmd.<tenant>.<namespace>.{agent.name}.<command>"
        )
    declared = agent.commands().get(command)
    if declared is None:
        known = ", ".join(sorted(agent.commands())) or "none"
        raise ConfigError(
            f"--agent {spec}: agent {agent.name!r} has no command {command!r} (commands: {known})"
        )
    if declared.payload is None:
        return  # declared as a plain dict: the handler checks it
    try:
        payloads.decoder(declared.payload).decode_body(env.encode())
    except InvalidPayload as exc:
        raise ConfigError(f"{env.type}: {exc}") from None


def raw_body(value: str) -> bytes:
    """``--raw``'s bytes: the text as UTF-8, or the named file's bytes for ``@FILE``."""
    if not value.startswith("@"):
        return value.encode()
    try:
        with open(value[1:], "rb") as f:
            return f.read()
    except OSError as exc:
        raise typer.BadParameter(
            f"cannot read {value[1:]!r}: {exc.strerror}", param_hint="--raw"
        ) from None


def build_envelope(subject: str, text: str, *, key: str | None, source: str) -> Envelope:
    """The envelope to send: from a whole envelope, or a payload and the subject's tokens."""
    from meshforge.envelope import Envelope, decode

    try:
        value: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedMessage(
            f"JSON argument is not valid JSON: {exc} (to send it as is, use --raw)"
        ) from None
    if not isinstance(value, dict):
        raise MalformedMessage(
            f"JSON argument must be an object, got a JSON {type(value).__name__} "
            "(to send it as is, use --raw)"
        )
    tokens = subject.split(".")
    tenant = tokens[1] if tokens[0] in ("cmd", "evt") and len(tokens) >= 5 else None
    if "type" in value and "payload" in value:
        value.setdefault("id", str(uuid.uuid4()))  # never derive an id from the bytes here
        if tenant and "tenant_id" not in value:
            value["tenant_id"] = tenant
        env = decode(json.dumps(value).encode())
        fresh = Envelope.new(env.type, env.payload, id=env.id)
        env = env.with_(
            source=value.get("source") or source,
            trace_id=env.trace_id or fresh.trace_id,
            span_id=env.span_id or fresh.span_id,
            correlation_id=env.correlation_id or env.id,
        )
        return env.with_(idempotency_key=key) if key else env
    if tenant is None:
        raise MalformedMessage(
            f"cannot derive a type from subject {subject!r}: give a whole envelope "
            '({"type": ..., "payload": {...}}) or use a cmd.<tenant>.<ns>.<agent>.<command> '
            "or evt.<tenant>.<ns>.<agent>.<event> subject"
        )
    # A partitioned command's sixth token is its partition, not part of the type.
    verb = (
        tokens[4]
        if tokens[0] == "cmd" and len(tokens) == 6 and tokens[5].isdigit()
        else ".".join(tokens[4:])
    )
    return Envelope.new(
        f"{tokens[3]}.{verb}",
        value,
        source=source,
        tenant_id=tenant,
        **({"idempotency_key": key} if key else {}),
    )


async def _publish(
    url: str, settings: Settings, subject: str, env: Envelope | bytes
) -> PublishResult:
    from meshforge.errors import PublishError
    from meshforge.publish.publisher import Publisher
    from meshforge.topology.provision import ensure
    from meshforge.topology.specs import default_streams
    from meshforge.topology.subjects import matches
    from meshforge.transport.connection import connect

    streams = default_streams(settings)
    ours = any(matches(pattern, subject) for spec in streams for pattern in spec.subjects)
    async with await connect(settings, url=url, name="meshforge-publish") as conn:
        publisher = Publisher(conn.js, settings)
        try:
            return await publisher.publish(subject, env)
        except PublishError as exc:
            if exc.kind == "no_stream" and not ours:
                covered = ", ".join(p for spec in streams for p in spec.subjects)
                raise PublishError(
                    f"no stream captures subject {subject!r}, and MeshForge's streams take only "
                    f"{covered}: publish under one of those, or create a stream for it "
                    "(e.g. nats stream add)",
                    kind="no_stream",
                ) from None
            if exc.kind != "no_stream" or not settings.provision:
                raise
        # A fresh server has no streams yet: create the CONTRACT ones, then try once more.
        await ensure(conn.js, streams, [])
        return await publisher.publish(subject, env)
