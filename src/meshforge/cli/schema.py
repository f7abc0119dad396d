"""``meshforge schema MODULE:AGENT ... [--nodes MODULE:NODE]``: the wire contract as AsyncAPI.

Writes an AsyncAPI 3.0.0 document (``--format asyncapi``, the default) of the agents'
commands and events and the nodes' control commands, or only their payloads as one JSON
Schema document (``--format json-schema``): to stdout, or to ``--out FILE`` (YAML when
FILE ends ``.yaml`` or ``.yml``). Nothing talks to NATS.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from meshforge.cli.common import Nodes, load_contract_parts


class Format(enum.StrEnum):
    asyncapi = "asyncapi"
    json_schema = "json-schema"


def register(app: typer.Typer) -> None:
    app.command("schema")(schema)


def schema(
    agents: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="MODULE:AGENT...", help="The agents, e.g. meshforge.demo:OrderAgent."
        ),
    ] = None,
    nodes: Nodes = None,
    fmt: Annotated[
        Format,
        typer.Option("--format", help="asyncapi: the whole document; json-schema: the payloads."),
    ] = Format.asyncapi,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Write it to FILE (YAML for .yaml/.yml) instead of stdout."),
    ] = None,
    title: Annotated[
        str | None, typer.Option("--title", help="The document's title (default: the names).")
    ] = None,
    api_version: Annotated[
        str | None,
        typer.Option("--api-version", help="info.version (default: the envelope version)."),
    ] = None,
) -> None:
    """Write the wire contract of agents and nodes: AsyncAPI 3.0.0, or JSON Schema payloads."""
    from meshforge.contract import asyncapi, payload_schemas
    from meshforge.envelope import SCHEMA_VERSION
    from meshforge.errors import ConfigError

    if not agents and not nodes:
        raise ConfigError("schema: name at least one MODULE:AGENT or --nodes MODULE:NODE")
    found, runs = load_contract_parts(agents, nodes)
    doc: dict[str, Any]
    if fmt is Format.asyncapi:
        doc = asyncapi(found, runs, title=title, version=api_version or SCHEMA_VERSION)
    else:
        doc = payload_schemas(found, runs)
    if out is None:
        typer.echo(json.dumps(doc, indent=2, ensure_ascii=False))
        return
    if out.suffix in (".yaml", ".yml"):
        import yaml

        text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
    else:
        text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--out {str(out)!r}: cannot write it: {exc.strerror}") from None
