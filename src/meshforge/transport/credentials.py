"""Auth and TLS options for nats-py, and keeping secrets out of everything printed.

One place turns ``AuthSettings`` (``meshforge.config.auth``: user/password, token, NKey
seed, credentials file, TLS paths) into ``nats.connect`` keyword arguments, for the
runtime (``connection.py``, from ``Settings``) and the Spark client (``spark/nats_sync.py``,
from its ``ConnOptions``) alike. Secrets never appear in an error from here: a bad seed
or URL is described, not echoed.

Example::

    options = nats_auth_options(AuthSettings(token="s3cret", tls_ca="ca.pem"))
    await nats.connect("tls://127.0.0.1:4222", **options)
"""

from __future__ import annotations

import os
import re
import ssl
from typing import Any

from meshforge.config.auth import HIDDEN, AuthSettings, check_nkey_seed, redact_url
from meshforge.errors import ConfigError, one_line

__all__ = [
    "DEFAULT_INBOX_PREFIX",
    "check_creds_file",
    "check_nkey_seed",
    "hide_secrets",
    "nats_auth_options",
    "redact_url",
    "ssl_context",
    "url_user",
    "user_inbox_prefix",
]

_SEED = re.compile(r"S[A-Z][A-Z2-7]{40,}")
# nats-py's own; a client using it shares its replies with every user granted _INBOX.>
DEFAULT_INBOX_PREFIX = "_INBOX"
_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_-]")
# user:password@ of a server URL (a lone user@ is a token: never put it in a subject)
_URL_USER = re.compile(r"^\s*(?:[A-Za-z][A-Za-z0-9+.\-]*://)?([^:@/]+):[^@/]*@")


def user_inbox_prefix(user: str | None) -> str:
    """The reply-inbox prefix of ``user``'s clients: ``_INBOX_<user>`` (a character a
    subject token cannot hold becomes ``_``), nats-py's ``_INBOX`` without a user.

    >>> user_inbox_prefix("acme.pub")
    '_INBOX_acme_pub'
    """
    return f"{DEFAULT_INBOX_PREFIX}_{_NOT_TOKEN.sub('_', user)}" if user else DEFAULT_INBOX_PREFIX


def url_user(servers: list[str] | tuple[str, ...]) -> str | None:
    """The user of the first ``user:password@`` server URL, if any.

    >>> url_user(["nats://h1:4222", "nats://bob:pw@h2:4222"])
    'bob'
    """
    for server in servers:
        found = _URL_USER.match(server)
        if found:
            return found.group(1)
    return None


def hide_secrets(text: str, secrets: tuple[str | None, ...] = ()) -> str:
    """``text`` with every given secret, URL user info and NKey seed replaced by ``***``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, HIDDEN)
    text = re.sub(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^\s/@,'\"]*@", rf"\g<1>{HIDDEN}@", text)
    return _SEED.sub(HIDDEN, text)


def check_creds_file(path: str, label: str = "creds_file") -> None:
    """A readable credentials file holding a user JWT and an NKey user seed.

    nats-py loops for ever on a file without the JWT block, so it is checked first.
    """
    _readable(label, path)
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            lines = [line.strip() for line in fh]
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read {path!r}: {exc.strerror}") from None
    blocks: dict[str, str] = {}
    for i, line in enumerate(lines[:-1]):
        for block in ("NATS USER JWT", "USER NKEY SEED"):
            if line.startswith("-----BEGIN") and block in line:
                blocks[block] = lines[i + 1]
    if "NATS USER JWT" not in blocks or blocks["NATS USER JWT"].count(".") != 2:
        raise ConfigError(
            f"{label}: expected a credentials file with a user JWT block, got {path!r}"
        )
    if "USER NKEY SEED" not in blocks:
        raise ConfigError(
            f"{label}: expected a credentials file with a user seed block, got {path!r}"
        )
    check_nkey_seed(blocks["USER NKEY SEED"], f"{label} {path!r}")


def _readable(name: str, path: str | None) -> None:
    if path is not None and not os.path.isfile(path):
        raise ConfigError(f"{name}: expected a readable file, got {path!r}")


def ssl_context(
    ca: str | None, cert: str | None, key: str | None, *, label: str = "tls"
) -> ssl.SSLContext | None:
    """A client SSL context trusting ``ca`` and presenting ``cert`` + ``key``; None when neither is set."""
    if not (ca or cert):
        return None
    for name, path in (("tls_ca", ca), ("tls_cert", cert), ("tls_key", key)):
        _readable(name, path)
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        if cert:
            context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{label}: cannot load certificates: {one_line(exc, 300)}") from None
    return context


def nats_auth_options(auth: AuthSettings, *, label: str = "tls") -> dict[str, Any]:
    """``nats.connect`` keyword arguments for ``auth``; ConfigError on a missing file or bad seed.

    Replies (JetStream API answers, PubAcks, pulled messages) come to ``inbox_prefix``:
    the setting, else one derived from the user, so that ``meshforge permissions`` can
    let each user subscribe to its own replies only.
    """
    options: dict[str, Any] = {}
    if auth.inbox_prefix is not None or auth.user is not None:
        options["inbox_prefix"] = auth.inbox_prefix or user_inbox_prefix(auth.user)
    if auth.user is not None:
        options["user"] = auth.user
        options["password"] = auth.password or ""
    if auth.token is not None:
        options["token"] = auth.token
    if auth.creds_file is not None:
        check_creds_file(auth.creds_file)
        options["user_credentials"] = auth.creds_file
    elif auth.nkey_seed is not None:
        options["nkeys_seed_str"] = check_nkey_seed(auth.nkey_seed)
    elif auth.nkey_seed_file is not None:
        _readable("nkey_seed_file", auth.nkey_seed_file)
        try:
            with open(auth.nkey_seed_file, encoding="ascii", errors="replace") as fh:
                check_nkey_seed(fh.read(), f"nkey_seed_file {auth.nkey_seed_file!r}")
        except OSError as exc:
            raise ConfigError(
                f"nkey_seed_file: cannot read {auth.nkey_seed_file!r}: {exc.strerror}"
            ) from None
        options["nkeys_seed"] = auth.nkey_seed_file
    tls = ssl_context(auth.tls_ca, auth.tls_cert, auth.tls_key, label=label)
    if tls is not None:
        options["tls"] = tls
    return options
