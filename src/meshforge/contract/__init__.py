"""The wire contract of agents and nodes, read from their declarations: AsyncAPI and JSON Schema.

Built on the runtime and the control plane (what agents and nodes declare) and used by
``meshforge schema`` and the console's Contract page.

Example::

    from meshforge.contract import asyncapi
    doc = asyncapi([OrderAgent], [DemoNode()])
"""

from __future__ import annotations

from meshforge.contract.asyncapi import ASYNCAPI_VERSION, asyncapi, payload_schemas

__all__ = ["ASYNCAPI_VERSION", "asyncapi", "payload_schemas"]
