"""Demo agents and the demo node, shipped with the package so they work after a plain install.

``meshforge.demo:OrderAgent``, ``meshforge.demo:InventoryAgent`` and
``meshforge.demo:DemoNode`` (see CONTRACT.md, "The demo agents" and "The control plane"),
and the agents' command payload types, for typed senders
(``publisher.send(InventoryAgent, CreateStock(sku="A-1", qty=5))``).
"""

from __future__ import annotations

__all__ = [
    "CreateOrder",
    "CreateStock",
    "DemoNode",
    "GetOrder",
    "GetStock",
    "InventoryAgent",
    "OrderAgent",
    "ReserveStock",
]
_AGENTS = frozenset(__all__) - {"DemoNode"}


def __getattr__(name: str) -> object:
    # Imported on first use so that loading one demo does not pull in the others' runtime.
    if name in _AGENTS:
        from meshforge.demo import agents

        return getattr(agents, name)
    if name == "DemoNode":
        from meshforge.demo import node

        return node.DemoNode
    raise AttributeError(f"module 'meshforge.demo' has no attribute {name!r}")
