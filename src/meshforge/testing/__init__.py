"""Testing helpers: run an agent in-process or in a real worker, and the pytest plugin.

``AgentHarness`` runs commands through the engine's own steps without a server (unit
tests); ``WorkerHarness`` runs a real worker on a real server. The pytest plugin
(``meshforge.testing.plugin``, installed as a ``pytest11`` entry point) provides the
fixtures ``meshforge_server``, ``meshforge_settings``, ``meshforge_store``,
``meshforge_connection``, ``agent_harness`` and ``agent_worker``; see docs/TESTING.md.

Example::

    def test_create(agent_harness):
        h = agent_harness(OrderAgent())
        assert h.send("create", {"sku": "A-1", "qty": 1}).event_types == ["order.created"]
"""

from meshforge.testing.harness import AgentHarness, HarnessDeadLetter, Sent
from meshforge.testing.live import WorkerHarness

__all__ = ["AgentHarness", "HarnessDeadLetter", "Sent", "WorkerHarness"]
