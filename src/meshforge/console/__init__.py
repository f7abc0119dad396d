"""The operator's web console (``meshforge console``): agents, dead letters, nodes, reports.

A thin client of the APIs the command line uses (``DeadLetters``, ``ControlClient``),
server-rendered with Jinja2 and refreshed in parts by htmx; see docs/CONSOLE.md.
"""

from meshforge.console.app import create_app
from meshforge.console.auth import ConsoleTokens

__all__ = ["ConsoleTokens", "create_app"]
