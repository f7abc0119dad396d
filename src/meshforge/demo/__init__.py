"""Demo agents and the demo node, shipped with the package so they work after a plain install.

``meshforge.demo:OrderAgent``, ``meshforge.demo:InventoryAgent`` and
``meshforge.demo:DemoNode`` (see CONTRACT.md, "The demo agents" and "The control plane").
"""

from __future__ import annotations

__all__ = ["DemoNode", "InventoryAgent", "OrderAgent"]


def __getattr__(name: str) -> object:
    # Imported on first use so that loading one demo does not pull in the others' runtime.
    if name in ("OrderAgent", "InventoryAgent"):
        from meshforge.demo import agents

        return getattr(agents, name)
    if name == "DemoNode":
        from meshforge.demo import node

        return node.DemoNode
    raise AttributeError(f"module 'meshforge.demo' has no attribute {name!r}")
