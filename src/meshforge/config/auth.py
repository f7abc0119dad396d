"""The auth and TLS settings: one type for the runtime's ``Settings`` and the Spark options.

``AuthSettings`` declares how a client proves who it is (user and password, token, NKey
seed or seed file, credentials file) and whom it trusts (TLS CA, client certificate and
key), and where its replies come (``inbox_prefix``). ``Settings`` is one (it adds the
rest of MeshForge's knobs), so is the Spark data source's ``ConnOptions``;
``meshforge.transport.credentials`` turns one into ``nats.connect`` arguments. Secrets stay
out of repr, and nothing here echoes one: a bad seed or URL is described, not shown.

Example::

    >>> AuthSettings(user="alice", password="s3cret")
    AuthSettings(user='alice', token=None, creds_file=None, nkey_seed_file=None, tls_ca=None, tls_cert=None, tls_key=None, inbox_prefix=None)
"""

from __future__ import annotations

import base64
import dataclasses
import re
from dataclasses import dataclass, field

from meshforge.errors import ConfigError

__all__ = ["AUTH_FIELDS", "HIDDEN", "AuthSettings", "check_nkey_seed", "redact_url"]

HIDDEN = "***"
# scheme://anything@ ... : everything up to the last "@" of a server is its user info
_USERINFO = re.compile(r"^(\s*(?:[A-Za-z][A-Za-z0-9+.\-]*://)?).*@")


@dataclass(frozen=True, slots=True)
class AuthSettings:
    """How a client proves who it is and whom it trusts; secrets are left out of repr."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds_file: str | None = None
    nkey_seed: str | None = field(default=None, repr=False)
    nkey_seed_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    inbox_prefix: str | None = None  # None: _INBOX_<user> (see credentials.user_inbox_prefix)

    @property
    def secrets(self) -> tuple[str | None, ...]:
        """The values that must never be printed."""
        return (self.password, self.token, self.nkey_seed)


#: The names of AuthSettings' fields, in order (settings and Spark options alike).
AUTH_FIELDS = tuple(f.name for f in dataclasses.fields(AuthSettings))


def redact_url(url: str) -> str:
    """The URL(s) without user name, password or token, fit for logs and errors.

    >>> redact_url("nats://alice:secret@host:4222,nats://h2:2")
    'nats://***@host:4222,nats://h2:2'
    """
    return ",".join(_USERINFO.sub(rf"\g<1>{HIDDEN}@", part).strip() for part in url.split(","))


def check_nkey_seed(seed: str, label: str = "nkey_seed") -> str:
    """The seed stripped, if it is an NKey user seed (``SU...``); never echoes it."""
    import nkeys

    value = seed.strip()
    try:
        prefix, _raw = nkeys.decode_seed(bytearray(value.encode()))
        # nkeys does not check the seed's CRC: a mistyped seed would only fail at login
        decoded = base64.b32decode(value + "=" * (-len(value) % 8))
        intact = bytes(nkeys.crc16_checksum(decoded[:-2])) == decoded[-2:]
    except Exception:  # nkeys raises its own error kinds (and binascii's) on any bad seed
        prefix, intact = None, False
    if prefix != nkeys.PREFIX_BYTE_USER or not intact:
        raise ConfigError(
            f"{label}: expected an NKey user seed (58 characters starting with SU), "
            f"got a value of {len(value)} characters that is not one (not shown)"
        )
    return value
