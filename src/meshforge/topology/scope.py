"""The tenant and namespace a message belongs to, taken from its subject.

NATS permissions protect subjects, not headers or bodies, so a command's subject
``cmd.<tenant>.<namespace>.<agent>.<command>`` is the only authority on whose it is.
A ``Scope`` is made from it once at admission; everything the runtime keeps for the
command (state, events, effects, inbox rows) is keyed by it.

Example::

    scope = Scope.of_subject("cmd.acme.shop.order.create")   # Scope('acme', 'shop')
    tenant_conflict(scope, header="acme", body="other")       # a one-line error
"""

from __future__ import annotations

import functools
from typing import NamedTuple

__all__ = ["DEFAULT_SCOPE", "Scope", "command_scope", "tenant_conflict"]

_SCOPED_PREFIXES = ("cmd", "evt")


class Scope(NamedTuple):
    """A tenant and a namespace; ``Scope()`` is the single-tenant default. A tuple, so it
    hashes and compares at C speed: every row the runtime keeps is keyed by one."""

    tenant: str = "default"
    namespace: str = "default"

    @classmethod
    def of_subject(cls, subject: str | None) -> Scope | None:
        """The scope of a ``cmd.``/``evt.`` subject of five tokens (a command: or six, the
        sixth its partition), else None."""
        if not subject:
            return None
        return _scope_of(subject)

    def __str__(self) -> str:
        return f"{self.tenant}/{self.namespace}"


@functools.lru_cache(maxsize=4096)  # subjects repeat (one per command type and partition)
def _scope_of(subject: str) -> Scope | None:
    tokens = subject.split(".")
    if len(tokens) == 6 and tokens[0] == "cmd" and tokens[5].isascii() and tokens[5].isdigit():
        tokens = tokens[:5]  # a partitioned command: same scope as unpartitioned
    if len(tokens) != 5 or tokens[0] not in _SCOPED_PREFIXES or not tokens[1] or not tokens[2]:
        return None
    return Scope(tokens[1], tokens[2])


DEFAULT_SCOPE = Scope()


def command_scope(subject: str | None, tenant: str | None = None) -> Scope:
    """The subject's scope; a message on another subject is ``tenant`` (or default), namespace default."""
    return Scope.of_subject(subject) or Scope(tenant or DEFAULT_SCOPE.tenant)


def tenant_conflict(scope: Scope, *, header: str | None, body: str | None) -> str | None:
    """A one-line reason when the ``Tenant-Id`` header or body ``tenant_id`` names another
    tenant than the subject; None when both agree or are absent."""
    for where, claimed in (("Tenant-Id header", header), ("body tenant_id", body)):
        if claimed and claimed != scope.tenant:
            shown = claimed if len(claimed) <= 64 else claimed[:64] + "..."
            return (
                f"{where} {shown!r} disagrees with the subject's tenant {scope.tenant!r};"
                " the subject is the tenant's authority"
            )
    return None
