"""Least-privilege NATS permissions for each MeshForge role, as a nats-server config block.

Each role gets the subjects its process publishes to and subscribes on, nothing more:

* ``admin``: provisioning (the whole JetStream API) and nothing else;
* ``agent``: a worker of the given agents started with ``--no-provision``: the start-up
  check, pull and ack on its own durables, what its agents emit, dead letters of its own
  commands, and ``$JS.API.INFO`` for ``/healthz``; with ``partitions`` set, the partition
  durables instead (and unpinning them: a new owner fences the previous one off) and its
  agents' keys in the ownership bucket;
* ``node``: a control-plane node with ``--no-provision``: its mailbox, its reply subject,
  dead letters of its mailbox, its presence key, and reading the jobs bucket (whether a
  job's command was canceled);
* ``publisher``: publishing commands (``meshforge publish``, an outbox relay); events
  only when named with ``subjects``: agents and the audit take an event as what happened;
* ``spark``: the pipeline: reading the given streams (ephemeral consumers and
  ``STREAM.MSG.GET``) and publishing to the subjects it writes.

Each user subscribes only to its own reply inbox, ``_INBOX_<user>.>`` (or the
``inbox_prefix`` its clients are given): JetStream API replies, PubAcks and pulled
messages arrive there, and no other user may read them (``_INBOX.>`` would let any user
read every other user's pulled commands and PubAcks).

Example::

    grant = role_grant("agent", Settings(), agents=["order"], tenant="acme")
    print(authorization_block([User("order-worker", grant)]))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshforge.config import Settings
from meshforge.errors import ConfigError, InvalidSubject
from meshforge.topology.partitions import BUCKET as PARTITIONS_BUCKET
from meshforge.topology.specs import agent_consumer, node_consumer, partition_consumers
from meshforge.topology.subjects import (
    JOBS_BUCKET,
    NODES_BUCKET,
    STREAM_COMMANDS,
    STREAM_EVENTS,
    STREAM_FAILED,
    control_reply_subject,
    validate_subject,
    validate_token,
)
from meshforge.transport.credentials import user_inbox_prefix

__all__ = [
    "DEFAULT_SPARK_STREAMS",
    "ROLES",
    "Grant",
    "User",
    "authorization_block",
    "inbox_subscription",
    "leaf_block",
    "leaf_user",
    "password_variable",
    "role_grant",
]

ROLES = ("admin", "agent", "node", "publisher", "spark")
HEALTH = "$JS.API.INFO"  # account info: what /healthz reports
DEFAULT_SPARK_STREAMS = (STREAM_EVENTS, STREAM_FAILED)
# Streams an agent worker checks at start (the control plane's are not its business).
_AGENT_STREAMS = (STREAM_COMMANDS, STREAM_EVENTS, STREAM_FAILED)


@dataclass(frozen=True, slots=True)
class Grant:
    """Subjects a user may publish to and subscribe on (allow lists); the user's own reply
    inbox is added to ``subscribe`` by ``authorization_block``."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class User:
    """One ``users`` entry: a name, where its password comes from, its grant, and the
    reply-inbox prefix its clients use (``MESHFORGE_INBOX_PREFIX``; None: from the name)."""

    name: str
    grant: Grant
    password: str | None = None  # None: the variable $<NAME>_PASSWORD
    inbox_prefix: str | None = None

    @property
    def inbox(self) -> str:
        """What the user subscribes to for its replies."""
        return inbox_subscription(self.name, self.inbox_prefix)


def inbox_subscription(user: str, inbox_prefix: str | None = None) -> str:
    """The one reply-inbox subscription a user is granted: what its clients' prefix covers.

    >>> inbox_subscription("acme-pub")
    '_INBOX_acme-pub.>'
    """
    if inbox_prefix is not None:
        validate_subject(inbox_prefix)
    return f"{inbox_prefix or user_inbox_prefix(user)}.>"


def _pull(stream: str, durable: str) -> list[str]:
    """Check, pull from and ack on one durable consumer."""
    return [
        f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    ]


def _bucket_reads(stream: str) -> list[str]:
    """Read a key-value bucket's stream: its info, and a key (direct, or by message get)."""
    return [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.STREAM.MSG.GET.{stream}",
    ]


def _unique(subjects: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(subjects))


def role_grant(
    role: str,
    settings: Settings | None = None,
    *,
    agents: Sequence[str] = (),
    tenant: str | None = None,
    namespace: str | None = None,
    site: str | None = None,
    nodes: Sequence[str] = (),
    streams: Sequence[str] = (),
    subjects: Sequence[str] = (),
    writes: Sequence[str] = (),
) -> Grant:
    """The grant of ``role``; raises ``ConfigError`` naming a missing or bad option.

    ``subjects`` is what a publisher may publish (default: the commands of ``tenant``;
    events only when named here); ``streams`` is what spark reads and ``writes`` what it
    publishes.

    >>> role_grant("admin").publish
    ('$JS.API.>',)
    """
    try:
        return _grant(
            role,
            settings or Settings(),
            agents,
            tenant,
            namespace,
            site,
            nodes,
            streams,
            subjects,
            writes,
        )
    except InvalidSubject as exc:  # a bad name is a bad option, like any other
        raise ConfigError(str(exc)) from None


def _grant(
    role: str,
    settings: Settings,
    agents: Sequence[str],
    tenant: str | None,
    namespace: str | None,
    site: str | None,
    nodes: Sequence[str],
    streams: Sequence[str],
    subjects: Sequence[str],
    writes: Sequence[str],
) -> Grant:
    for value, what in ((tenant, "tenant"), (namespace, "namespace"), (site, "site")):
        if value is not None:
            validate_token(value, what)
    for subject in (*subjects, *writes):
        validate_subject(subject, wildcards=True)
    t, ns = tenant or "*", namespace or "*"
    if role == "admin":
        return Grant(("$JS.API.>",))
    if role == "agent":
        if not agents:
            raise ConfigError("permissions agent: name the agents with --agent NAME (repeatable)")
        out = [HEALTH, *(f"$JS.API.STREAM.INFO.{s}" for s in _AGENT_STREAMS)]
        if not (tenant or namespace):
            # What a durable left unacknowledged, read by sequence at a take-over so its
            # resources keep their order (meshforge.runtime.holds). Not for a bound role:
            # a read by sequence is not limited to its tenant's subjects.
            out.append(f"$JS.API.STREAM.MSG.GET.{STREAM_COMMANDS}")
        if settings.partitions:
            out += _bucket_reads(f"KV_{PARTITIONS_BUCKET}")
        for agent in agents:
            if settings.partitions:
                group = partition_consumers(agent, settings, tenant, namespace)
                for part in group.values():
                    out += _pull(part.stream, part.durable)
                    out.append(f"$JS.API.CONSUMER.UNPIN.{part.stream}.{part.durable}")
                stem = group["u"].durable.removesuffix("_unpartitioned")
                out += [f"$KV.{PARTITIONS_BUCKET}.{kind}.{stem}.*" for kind in ("lease", "worker")]
            else:
                spec = agent_consumer(agent, settings, tenant, namespace)
                out += _pull(spec.stream, spec.durable)
            out += [
                f"evt.{t}.{ns}.{agent}.>",  # its events
                f"failed.cmd.{t}.{ns}.{agent}.>",  # dead letters of its commands
            ]
        out.append(f"cmd.{t}.{ns}.>" if tenant or namespace else "cmd.>")  # commands it sends
        return Grant(_unique(out))
    if role == "node":
        if site is None or not nodes:
            raise ConfigError("permissions node: give --site SITE and --node NODE (repeatable)")
        out = [HEALTH, f"$JS.API.STREAM.INFO.KV_{NODES_BUCKET}"]
        out += _bucket_reads(f"KV_{JOBS_BUCKET}")  # is a job's command canceled?
        for node in nodes:
            spec = node_consumer(site, node, settings)
            out += _pull(spec.stream, spec.durable)
            out += [
                control_reply_subject(site, node),
                f"failed.control.cmd.{site}.{node}",
                f"$KV.{NODES_BUCKET}.{site}.{node}",  # presence
            ]
        return Grant(_unique(out))
    if role == "publisher":
        scope = f"{t}.{ns}.>" if namespace else f"{t}.>" if tenant else ">"
        return Grant(_unique([HEALTH, *(subjects or [f"cmd.{scope}"])]))
    if role == "spark":
        out = []
        for stream in streams or DEFAULT_SPARK_STREAMS:
            validate_token(stream, "stream")
            out += [
                f"$JS.API.STREAM.INFO.{stream}",
                f"$JS.API.STREAM.MSG.GET.{stream}",  # work-queue streams: read by sequence
                f"$JS.API.CONSUMER.CREATE.{stream}.>",  # limits streams: ephemeral consumers
                f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
                f"$JS.API.CONSUMER.DELETE.{stream}.>",
            ]
        return Grant(_unique([*out, *writes]))
    raise ConfigError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")


def _quoted(items: Sequence[str], indent: str) -> str:
    return "\n".join(f'{indent}"{item}"' for item in items)


def password_variable(user: str) -> str:
    """``<USER>_PASSWORD`` (upper case, other characters as ``_``): the environment
    variable nats-server takes the user's password from.

    >>> password_variable("meshforge-agent")
    'MESHFORGE_AGENT_PASSWORD'
    """
    clean = "".join(ch if ch.isalnum() else "_" for ch in user).upper()
    return f"{clean}_PASSWORD"


def leaf_user(site: str) -> str:
    """The user a site's leaf connection logs in to the hub as: ``meshforge-leaf-<site>``."""
    return f"meshforge-leaf-{validate_token(site, 'site')}"


def leaf_block(sites: Sequence[str]) -> str:
    """The hub's ``authorization`` block for its ``leafnodes``: one user per site, its
    password the variable ``$MESHFORGE_LEAF_<SITE>_PASSWORD`` (never written here). The
    link carries only what the site's remote allows (sources; not ``control.>``)."""
    entries = [
        f'    {{ user: "{leaf_user(site)}", password: ${password_variable(leaf_user(site))} }}'
        for site in sites
    ]
    return "authorization {\n  users = [\n" + "\n".join(entries) + "\n  ]\n}\n"


def authorization_block(users: Sequence[User]) -> str:
    """A nats-server ``authorization { users = [...] }`` block, one subject per line.

    Passwords are never written: each user's is ``$<USER>_PASSWORD``, which
    nats-server takes from its environment (or a bcrypt hash you put in its place).
    Each user may subscribe to its own reply inbox; two users sharing one is refused.
    """
    entries = []
    owners: dict[str, str] = {}
    for user in users:
        try:
            inbox = user.inbox
        except InvalidSubject as exc:
            raise ConfigError(f"inbox prefix of {user.name!r}: {exc}") from None
        if owners.setdefault(inbox, user.name) != user.name:
            raise ConfigError(
                f"users {owners[inbox]!r} and {user.name!r} would share the reply inbox {inbox!r}: rename one"
            )
        subscribe = _unique([inbox, *user.grant.subscribe])
        password = user.password or f"${password_variable(user.name)}"
        entries.append(
            f'    {{\n      user: "{user.name}"\n      password: {password}\n'
            "      permissions: {\n"
            "        publish: {\n          allow: [\n"
            f"{_quoted(user.grant.publish, '            ')}\n          ]\n        }}\n"
            "        subscribe: {\n          allow: [\n"
            f"{_quoted(subscribe, '            ')}\n          ]\n        }}\n"
            "      }\n    }"
        )
    return "authorization {\n  users = [\n" + "\n".join(entries) + "\n  ]\n}\n"
