"""Servers configured for each NATS auth method, and the keys and certificates they need.

Certificates come from the ``openssl`` CLI; NKeys and JWTs from the ``nkeys`` library: a
JWT is base64url(header).base64url(claims).base64url(ed25519 signature of the first two).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nkeys

from meshforge.transport.server import EmbeddedServer


# ---------------------------------------------------------------- NKeys and JWTs
@dataclass(frozen=True)
class Key:
    seed: str
    public: str


def new_key(prefix: int) -> Key:
    """A fresh NKey of a role (nkeys.PREFIX_BYTE_OPERATOR / _ACCOUNT / _USER)."""
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    pair = nkeys.from_seed(bytearray(seed))
    return Key(seed=seed.decode(), public=pair.public_key.decode())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_jwt(issuer: Key, subject: str, name: str, nats: dict[str, object]) -> str:
    """A NATS JWT for ``subject`` signed by ``issuer``."""
    claims: dict[str, object] = {
        "iat": int(time.time()),
        "iss": issuer.public,
        "name": name,
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    digest = hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    signature = nkeys.from_seed(bytearray(issuer.seed.encode())).sign(f"{head}.{body}".encode())
    return f"{head}.{body}.{_b64(signature)}"


_UNLIMITED = {
    "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
    "conn": -1, "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
}  # fmt: skip


@dataclass(frozen=True)
class Operator:
    """An operator, a system account, one account with JetStream and a user of it, as JWTs."""

    operator: Key
    system: Key
    account: Key
    user: Key
    operator_jwt: str
    system_jwt: str
    account_jwt: str
    user_jwt: str

    def config(self) -> str:
        """nats-server config lines: operator mode with the accounts preloaded in memory."""
        return (
            f"operator: {self.operator_jwt}\n"
            f"system_account: {self.system.public}\n"
            "resolver: MEMORY\n"
            "resolver_preload: {\n"
            f"  {self.system.public}: {self.system_jwt}\n"
            f"  {self.account.public}: {self.account_jwt}\n"
            "}\n"
        )

    def creds(self, path: Path, user_jwt: str | None = None, seed: str | None = None) -> Path:
        """A credentials file (user JWT + seed) in the layout ``nsc`` writes."""
        path.write_text(
            "-----BEGIN NATS USER JWT-----\n"
            f"{user_jwt or self.user_jwt}\n"
            "------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n\n"
            "-----BEGIN USER NKEY SEED-----\n"
            f"{seed or self.user.seed}\n"
            "------END USER NKEY SEED------\n"
        )
        return path


def make_operator() -> Operator:
    operator = new_key(nkeys.PREFIX_BYTE_OPERATOR)
    system = new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    account = new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    user = new_key(nkeys.PREFIX_BYTE_USER)
    account_nats = {
        "type": "account",
        "limits": _UNLIMITED,
        "default_permissions": {"pub": {}, "sub": {}},
    }
    user_nats = {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1}
    return Operator(
        operator=operator,
        system=system,
        account=account,
        user=user,
        operator_jwt=make_jwt(operator, operator.public, "test-operator", {"type": "operator"}),
        system_jwt=make_jwt(operator, system.public, "SYS", {"type": "account"}),
        account_jwt=make_jwt(operator, account.public, "test-account", account_nats),
        user_jwt=make_jwt(account, user.public, "test-user", user_nats),
    )


# ---------------------------------------------------------------- certificates
def make_certs(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1, a client certificate, and another CA."""
    directory.mkdir(parents=True, exist_ok=True)
    names = ("ca", "ca-key", "srv", "srv-key", "cli", "cli-key", "other-ca", "other-ca-key")
    p = {n: directory / f"{n}.pem" for n in names}
    ext = directory / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        run("req", "-x509", *ec, "-keyout", str(p[f"{ca}-key"]), "-out", str(p[ca]),
            "-days", "1", "-subj", f"/CN=meshforge-test-{ca}")  # fmt: skip
    for name, cn in (("srv", "127.0.0.1"), ("cli", "meshforge-client")):
        csr = directory / f"{name}.csr"
        run(
            "req",
            "-new",
            *ec,
            "-keyout",
            str(p[f"{name}-key"]),
            "-out",
            str(csr),
            "-subj",
            f"/CN={cn}",
        )
        run("x509", "-req", "-in", str(csr), "-CA", str(p["ca"]), "-CAkey", str(p["ca-key"]),
            "-CAcreateserial", "-out", str(p[name]), "-days", "1", "-extfile", str(ext))  # fmt: skip
    return p


def tls_block(certs: dict[str, Path], *, verify: bool = False) -> str:
    """A nats-server ``tls`` block; ``verify`` asks every client for a certificate."""
    lines = [f'  cert_file: "{certs["srv"]}"', f'  key_file: "{certs["srv-key"]}"']
    if verify:
        lines += [f'  ca_file: "{certs["ca"]}"', "  verify: true"]
    return "tls {\n" + "\n".join(lines) + "\n}\n"


@contextlib.contextmanager
def configured_server(directory: Path, config: str) -> Iterator[EmbeddedServer]:
    """An embedded nats-server (JetStream, free port) started with ``config`` as its file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "server.conf"
    path.write_text(config)
    with EmbeddedServer(store_dir=directory / "nats", extra_args=["-c", str(path)]) as server:
        yield server
