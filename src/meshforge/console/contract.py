"""The Contract page: the AsyncAPI document of the agents and nodes the console was given.

Read-only, for any signed-in role: each operation with its subject, message and payload
schema, the headers, and the whole document (``/contract.json``, what ``meshforge
schema`` writes for the same agents). The document is made once, when the console
starts (``meshforge console --agent MODULE:AGENT --node MODULE:NODE``); a console bound
to a tenant shows that tenant only and no nodes (they belong to sites).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from meshforge.console.web import console_of, page, render

__all__ = ["routes"]


def _resolved(doc: dict[str, Any], schema: Any) -> Any:
    """A schema that is a ``#/components/...`` reference, as the schema it names."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return schema
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node.get(part.replace("~1", "/").replace("~0", "~"), {})
    return node


def _message(doc: dict[str, Any], ref: dict[str, str]) -> dict[str, Any]:
    """The message an operation's ``#/channels/<c>/messages/<m>`` refers to."""
    return dict(_resolved(doc, _resolved(doc, ref)))


def _payload(doc: dict[str, Any], message: dict[str, Any]) -> tuple[str, Any]:
    """The name and schema of a message's ``payload`` field (the envelope's), or of the
    whole body when it is not an envelope (a dead letter)."""
    body = message.get("payload", {})
    parts = body.get("allOf") if isinstance(body, dict) else None
    if not parts:
        return "body", body
    field = parts[-1]["properties"]["payload"]
    ref = field.get("$ref", "")
    return (ref.rsplit("/", 1)[-1] if ref else "object"), _resolved(doc, field)


def _view(doc: dict[str, Any]) -> dict[str, Any]:
    operations = []
    for op_id, operation in doc["operations"].items():
        channel = _resolved(doc, operation["channel"])
        message = _message(doc, operation["messages"][0])
        name, schema = _payload(doc, message)
        operations.append(
            {
                "id": op_id,
                "owner": ", ".join(tag["name"] for tag in operation.get("tags", [])),
                "action": operation["action"],
                "address": channel["address"],
                "message": message.get("name", ""),
                "payload_name": name,
                "payload": json.dumps(schema, indent=2, ensure_ascii=False),
                "description": message.get("description", ""),
                "reply": _resolved(doc, operation["reply"]["channel"])["address"]
                if "reply" in operation
                else "",
            }
        )
    schemas = doc["components"]["schemas"]
    envelope = schemas["EnvelopeHeaders"]["properties"]
    control = schemas["ControlHeaders"]["properties"]
    headers = [
        ("Every envelope", envelope),
        ("A node's command, besides", {k: v for k, v in control.items() if k not in envelope}),
        ("A dead letter, besides the producer's", schemas["DeadLetterHeaders"]["properties"]),
        ("A kept original's chunk", schemas["OriginalChunkHeaders"]["properties"]),
    ]
    return {
        "info": doc["info"],
        "asyncapi": doc["asyncapi"],
        "owners": doc["info"].get("tags", []),
        "operations": operations,
        "headers": headers,
        "document": json.dumps(doc, indent=2, ensure_ascii=False),
    }


@page
async def contract(request: Request) -> Response:
    doc = console_of(request).contract
    return render(request, "contract.html", {"view": _view(doc) if doc else None})


@page
async def document(request: Request) -> Response:
    doc = console_of(request).contract
    if doc is None:
        return PlainTextResponse("no contract: the console was started without --agent", 404)
    return JSONResponse(
        doc, headers={"Content-Disposition": 'attachment; filename="asyncapi.json"'}
    )


routes = [
    Route("/contract", contract),
    Route("/contract.json", document),
]
