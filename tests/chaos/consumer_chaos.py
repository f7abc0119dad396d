"""Helpers for the consumer chaos tests: settings without the environment, polling."""

from __future__ import annotations

from meshforge.config import Settings, load_settings


def settings(**values: object) -> Settings:
    """Settings from these values and defaults only (no environment, no file)."""
    return load_settings(values, env={})
