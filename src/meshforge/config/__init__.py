"""Settings: from arguments, the environment, a TOML file or defaults, validated once.

``settings.py`` reads and checks every setting (``load_settings``); ``auth.py`` declares
the auth and TLS settings once (``AuthSettings``), for ``Settings`` and the Spark options.
This folder imports nothing of MeshForge but ``errors``: everything else may import it.

Example::

    >>> s = load_settings({"max_deliver": 3}, env={"MESHFORGE_ACK_WAIT": "1m"})
    >>> (s.max_deliver, s.ack_wait)
    (3, 60.0)
"""

from __future__ import annotations

from meshforge.config.auth import AuthSettings
from meshforge.config.settings import (
    ENV_PREFIX,
    SECRET_SETTINGS,
    Settings,
    load_auth,
    load_settings,
    parse_backoff,
    parse_duration,
    parse_setting,
    redelivery_span,
)

__all__ = [
    "ENV_PREFIX",
    "SECRET_SETTINGS",
    "AuthSettings",
    "Settings",
    "load_auth",
    "load_settings",
    "parse_backoff",
    "parse_duration",
    "parse_setting",
    "redelivery_span",
]
