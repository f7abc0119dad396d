"""A small shop with typed agents: see ``agents.py`` and ``send.py``."""
