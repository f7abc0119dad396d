"""Provisioning: compare stream and consumer specs with the server, then act.

``plan`` reads the server and says, for each spec, create / update (with a field-by-field
diff) / unchanged / refused (and why). It refuses what JetStream cannot change in place
(retention, storage, a consumer's ack or deliver policy), a consumer's filter (another
worker may rely on it), a stream whose subjects overlap
another stream's (existing or planned, naming both), and a consumer whose filter overlaps
another consumer's on a work-queue stream. ``apply`` executes a plan with no refusals and,
if it fails half-way, says exactly what was and was not done. ``ensure`` is both.
``verify`` is for runtimes without JetStream API write permission: it only reads.

Example::

    planned = await plan(js, default_streams(settings), [agent_consumer("order", settings)])
    for step in planned.steps:
        print(step.action, step.kind, step.name, step.details)
    report = await apply(js, planned)      # report.changed is False on a second run
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamManager
from nats.js.api import ConsumerConfig, StreamConfig, StreamInfo
from nats.js.errors import APIError, NotFoundError

from meshforge.errors import MissingTopology, OverlapError, TopologyError, one_line
from meshforge.topology.specs import (
    SERVER_DEFAULT_CONSUMERS,
    Action,
    ApplyReport,
    Change,
    ConsumerSpec,
    GroupedConsumerConfig,
    Plan,
    Step,
    StreamSpec,
    Verification,
    describe_consumer,
    describe_stream,
    diff,
    js_api,
    policy_name,
)
from meshforge.topology.subjects import STREAM_CONTROL, find_overlaps, overlaps

__all__ = [
    "Action",
    "ApplyReport",
    "Change",
    "Plan",
    "Step",
    "Verification",
    "apply",
    "ensure",
    "plan",
    "verify",
]

log = logging.getLogger("meshforge.provision")
T = TypeVar("T")
# The server's error code for a consumer past its stream's max_consumers.
_CONSUMER_LIMIT = 10026


# ------------------------------------------------------------------ reading the server


async def _list_all(fetch: Callable[[int], Awaitable[tuple[list[T], int | None]]]) -> list[T]:
    """Every item of a paged JetStream listing; ``fetch(offset)`` gives a page and the total.

    The offset advances by what each page returned, not by distinct names: the server
    counts entries it leaves out of a page (a consumer offline, or closing while another
    process creates it), and a loop waiting for the number of names to grow never ends.
    """
    items: list[T] = []
    while True:
        page, total = await fetch(len(items))
        items.extend(page)
        if not page or (total is not None and len(items) >= total):
            return items


async def _existing_streams(js: JetStreamManager) -> dict[str, StreamConfig]:
    async def fetch(offset: int) -> tuple[list[StreamInfo], int | None]:
        page = await js.streams_info_iterator(offset)
        return list(page), getattr(page, "total", None)

    return {str(info.config.name): info.config for info in await _list_all(fetch)}


async def _existing_consumers(js: JetStreamManager, stream: str) -> dict[str, ConsumerConfig]:
    """Every consumer's config, read raw: nats-py's ``ConsumerInfo`` drops the priority
    group fields, which a partition durable must keep (and be compared on)."""

    async def fetch(offset: int) -> tuple[list[tuple[str, ConsumerConfig]], int | None]:
        resp = await js_api(js, f"CONSUMER.LIST.{stream}", {"offset": offset})
        page: list[tuple[str, ConsumerConfig]] = [
            (c["name"], GroupedConsumerConfig.from_response(c["config"]))
            for c in resp.get("consumers") or []
        ]
        return page, None

    return dict(await _list_all(fetch))


async def _named_consumers(
    js: JetStreamManager, stream: str, durables: Sequence[str]
) -> dict[str, ConsumerConfig]:
    """The configs of these consumers only, one info request each (read raw, as above)."""
    found: dict[str, ConsumerConfig] = {}
    for durable in durables:
        try:
            info = await js_api(js, f"CONSUMER.INFO.{stream}.{durable}")
        except NotFoundError:
            continue
        found[durable] = GroupedConsumerConfig.from_response(info["config"])
    return found


async def _consumers_of(
    js: JetStreamManager, stream: str, specs: Sequence[ConsumerSpec]
) -> dict[str, ConsumerConfig]:
    """What ``plan`` needs to know of ``stream``'s consumers to plan ``specs``.

    A spec with a wildcard filter is checked against every other consumer (on a work-queue
    stream their filters must not overlap): the stream's consumers are listed. Specs with
    literal filters only (a node's mailbox) are read by name: a node's start then costs
    the same with 10 or 10,000 other nodes, and a filter that overlaps a wildcard
    consumer's is refused by the server when it is created, naming the cause.
    """
    if any(_wildcard(s.filter_subject) for s in specs):
        return await _existing_consumers(js, stream)
    return await _named_consumers(js, stream, [s.durable for s in specs])


def _wildcard(subject: str) -> bool:
    return any(token in ("*", ">") for token in subject.split("."))


def _unique(names: Sequence[str], what: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise TopologyError(f"{what} {name} is specified twice")
        seen.add(name)


async def plan(
    js: JetStreamManager, streams: Sequence[StreamSpec], consumers: Sequence[ConsumerSpec] = ()
) -> Plan:
    """Compare the specs with the server (read-only) and return the steps to take."""
    _unique([s.name for s in streams], "stream")
    _unique([c.name for c in consumers], "consumer")
    try:
        existing = await _existing_streams(js)
        consumers_now = {
            name: await _consumers_of(js, name, [c for c in consumers if c.stream == name])
            for name in sorted({c.stream for c in consumers} & set(existing))
        }
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # nats errors of every kind: one line naming the failure
        raise TopologyError(f"cannot read the JetStream topology: {_why(js, exc)}") from exc
    steps = [_plan_stream(spec, existing, streams) for spec in streams]
    stream_subjects = {name: list(cfg.subjects or []) for name, cfg in existing.items()}
    retention = {name: policy_name(cfg.retention) for name, cfg in existing.items()}
    replicas = {name: cfg.num_replicas or 1 for name, cfg in existing.items()}
    for stream_spec in streams:
        stream_subjects[stream_spec.name] = list(stream_spec.subjects)
        retention[stream_spec.name] = stream_spec.retention
        replicas[stream_spec.name] = stream_spec.replicas
    for consumer_spec in consumers:
        stream_replicas = replicas.get(consumer_spec.stream)
        steps.append(
            _plan_consumer(
                consumer_spec, stream_subjects, retention, consumers_now, consumers, stream_replicas
            )
        )
    return Plan(tuple(steps))


def _plan_stream(
    spec: StreamSpec, existing: dict[str, StreamConfig], planned: Sequence[StreamSpec]
) -> Step:
    others = {name: list(cfg.subjects or []) for name, cfg in existing.items() if name != spec.name}
    for other in planned:
        if other.name != spec.name:
            others[other.name] = list(other.subjects)  # the planned form replaces the present one
    for other_name, subjects in sorted(others.items()):
        pairs = find_overlaps(spec.subjects, subjects)
        if pairs:
            mine, theirs = pairs[0]
            reason = (
                f"subjects overlap stream {other_name}: {mine!r} ({spec.name}) and {theirs!r} "
                f"({other_name}) would capture the same messages"
            )
            return Step("stream", spec, Action.REFUSED, reason=reason, overlap=True)
    current = existing.get(spec.name)
    if current is None:
        return Step("stream", spec, Action.CREATE)
    if current.mirror is not None or current.sealed:
        what = "a mirror" if current.mirror is not None else "sealed"
        return Step(
            "stream", spec, Action.REFUSED, reason=f"the existing stream is {what}", current=current
        )
    changes = diff(describe_stream(current), describe_stream(spec.config()))
    fixed = [c for c in changes if c.field in ("retention", "storage")]
    if fixed:
        what = ", ".join(str(c) for c in fixed)
        reason = (
            f"JetStream cannot change a stream's {' or '.join(c.field for c in fixed)} ({what}); "
            "delete the stream (its messages are lost) and provision again"
        )
        return Step("stream", spec, Action.REFUSED, changes, reason=reason, current=current)
    action = Action.UPDATE if changes else Action.UNCHANGED
    return Step("stream", spec, action, changes, current=current)


def _plan_consumer(
    spec: ConsumerSpec,
    stream_subjects: dict[str, list[str]],
    retention: dict[str, str],
    consumers_now: dict[str, dict[str, ConsumerConfig]],
    planned: Sequence[ConsumerSpec],
    stream_replicas: int | None = None,
) -> Step:
    """``stream_replicas``: the stream's as planned, what a consumer's replicas 0 follows."""

    def refuse(
        reason: str, *, overlap: bool = False, current: ConsumerConfig | None = None
    ) -> Step:
        return Step(
            "consumer", spec, Action.REFUSED, reason=reason, overlap=overlap, current=current
        )

    subjects = stream_subjects.get(spec.stream)
    if subjects is None:
        return refuse(f"stream {spec.stream} neither exists nor is planned")
    if not any(overlaps(spec.filter_subject, s) for s in subjects):
        return refuse(
            f"filter {spec.filter_subject!r} is outside stream {spec.stream}'s subjects ({', '.join(subjects)})"
        )
    present = consumers_now.get(spec.stream, {})
    if retention.get(spec.stream) == "workqueue":
        # A work-queue stream hands each message to one consumer: filters must not overlap.
        others = {
            n: describe_consumer(c)["filter_subject"]
            for n, c in present.items()
            if n != spec.durable
        }
        others.update(
            {
                c.durable: c.filter_subject
                for c in planned
                if c.stream == spec.stream and c.durable != spec.durable
            }
        )
        for name, other_filter in sorted(others.items()):
            pattern = ">" if other_filter == "(all)" else other_filter
            if any(overlaps(spec.filter_subject, f.strip()) for f in pattern.split(",")):
                return refuse(
                    f"filter {spec.filter_subject!r} overlaps consumer {name} ({other_filter!r}) on "
                    f"work-queue stream {spec.stream}",
                    overlap=True,
                )
    kind = retention.get(spec.stream)
    if kind in ("workqueue", "interest") and spec.replicas not in (0, stream_replicas or 0):
        return refuse(
            f"replicas {spec.replicas} differ from stream {spec.stream}'s {stream_replicas}: "
            f"JetStream requires a {kind} stream's consumers to have the stream's replicas "
            f"(set consumer_replicas to {stream_replicas} or 0)"
        )
    current = present.get(spec.durable)
    if current is None:
        return Step("consumer", spec, Action.CREATE)
    fixed = []
    if policy_name(current.ack_policy) != "explicit":
        fixed.append(f"ack_policy {policy_name(current.ack_policy)} -> explicit")
    if policy_name(current.deliver_policy) != "all":
        fixed.append(f"deliver_policy {policy_name(current.deliver_policy)} -> all")
    if current.deliver_subject:
        fixed.append("push -> pull")
    if fixed:
        return refuse(
            f"JetStream cannot change a consumer's {'; '.join(fixed)}; delete the consumer "
            "(its delivery state is lost) and provision again",
            current=current,
        )
    changes = diff(
        describe_consumer(current, stream_replicas),
        describe_consumer(spec.config(), stream_replicas),
    )
    refiltered = [c for c in changes if c.field == "filter_subject"]
    if refiltered:
        # Another worker may consume through this filter: rewriting it would strand its messages.
        return refuse(
            f"consumer {spec.durable} is filtered {refiltered[0].current!r}, not "
            f"{refiltered[0].desired!r}; a worker may rely on its filter, so it is not rewritten: "
            "bind this worker to its own tenant/namespace or delete the consumer first",
            current=current,
        )
    action = Action.UPDATE if changes else Action.UNCHANGED
    return Step("consumer", spec, action, changes, current=current)


# ------------------------------------------------------------------ applying


def _own_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """Metadata without the server's reserved ``_nats.`` keys (it sets those itself)."""
    if not metadata:
        return None
    kept = {k: v for k, v in metadata.items() if not k.startswith("_nats.")}
    return kept or None


async def _execute(js: JetStreamManager, step: Step) -> None:
    spec = step.spec
    if isinstance(spec, StreamSpec):
        wanted = spec.config()
        if step.action is Action.CREATE:
            await js.add_stream(wanted)
            return
        assert isinstance(step.current, StreamConfig)
        managed = (
            "subjects",
            "discard",
            "duplicate_window",
            "num_replicas",
            "max_age",
            "max_bytes",
            "allow_msg_ttl",
            "max_consumers",
        )
        updated = step.current.evolve(
            metadata=_own_metadata(step.current.metadata),
            **{k: getattr(wanted, k) for k in managed},
        )
        await js.update_stream(updated)
        return
    config = spec.config()
    if step.action is Action.UPDATE:
        assert isinstance(step.current, ConsumerConfig)
        # Read raw, the current config keeps its priority group; the spec's replaces it (a
        # partition durable made before it had one gets it now).
        config = GroupedConsumerConfig(
            **vars(step.current)
        ).evolve(
            name=None,  # the durable name selects the consumer; a name would put the filter in the API subject
            metadata=_own_metadata(step.current.metadata),
            filter_subject=config.filter_subject,
            ack_wait=config.ack_wait,
            max_deliver=config.max_deliver,
            backoff=config.backoff,
            num_replicas=config.num_replicas,
            priority_groups=getattr(config, "priority_groups", None),
            priority_policy=getattr(config, "priority_policy", None),
            priority_timeout=getattr(config, "priority_timeout", None),
        )
    await js.add_consumer(spec.stream, config)


async def apply(js: JetStreamManager, planned: Plan) -> ApplyReport:
    """Execute a plan. Refuses the whole plan if any step is refused (nothing is changed).

    Raises ``OverlapError`` when a refusal is an overlap, ``TopologyError`` otherwise, and
    ``TopologyError`` naming what was done and what was not if a step fails half-way.
    """
    if planned.refused:
        grouped: dict[str, list[str]] = {}
        for refused in planned.refused:
            grouped.setdefault(refused.reason, []).append(f"{refused.kind} {refused.name}")
        reasons = "; ".join(f"{', '.join(names)}: {reason}" for reason, names in grouped.items())
        error = OverlapError if any(s.overlap for s in planned.refused) else TopologyError
        raise error(f"refusing to provision, nothing was changed: {reasons}")
    done: list[Step] = []
    pending = planned.pending
    for index, step in enumerate(pending):
        try:
            await _execute(js, step)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any server or transport error stops the run here
            if isinstance(step.spec, ConsumerSpec) and _at_consumer_limit(exc):
                raise TopologyError(_limit_reached(step.spec, planned)) from exc
            not_done = ", ".join(str(s) for s in pending[index + 1 :]) or "nothing else"
            raise TopologyError(
                f"{step} failed: {_why(js, exc)}; done: "
                f"{', '.join(str(s) for s in done) or 'nothing'}; not done: {step}, {not_done}"
            ) from exc
        log.info("provisioned: %s %s", step, step.details)
        done.append(step)
    return ApplyReport(planned.steps, tuple(done))


async def ensure(
    js: JetStreamManager, streams: Sequence[StreamSpec], consumers: Sequence[ConsumerSpec] = ()
) -> ApplyReport:
    """Plan and apply: idempotent; a second run on an unchanged server changes nothing.

    Example::

        report = await ensure(conn.js, default_streams(settings), [agent_consumer("order", settings)])
    """
    return await apply(js, await plan(js, streams, consumers))


def _at_consumer_limit(exc: BaseException) -> bool:
    return isinstance(exc, APIError) and exc.err_code == _CONSUMER_LIMIT


def _limit_reached(spec: ConsumerSpec, planned: Plan) -> str:
    """One line: which stream is full, at what limit, and the setting that raises it."""
    limits = [
        s.spec.max_consumers
        for s in planned.steps
        if isinstance(s.spec, StreamSpec) and s.spec.name == spec.stream
    ]
    if limits and limits[0] < 1:  # the stream sets none: the account's or the server's
        return (
            f"consumer {spec.durable} refused: stream {spec.stream} sets no consumer limit, "
            "but the account's max_consumers or the server's jetstream default_max_consumers "
            f"({SERVER_DEFAULT_CONSUMERS} on nats-server 2.15) is reached; raise that limit"
        )
    at = f" of {limits[0]}" if limits else ""
    fix = (
        "raise the setting control_max_consumers (MESHFORGE_CONTROL_MAX_CONSUMERS; -1: "
        "unlimited) and run `meshforge provision`"
        if spec.stream == STREAM_CONTROL
        else f"raise stream {spec.stream}'s max_consumers"
    )
    return (
        f"consumer {spec.durable} refused: stream {spec.stream} is at its consumer "
        f"limit{at} (max_consumers); {fix}"
    )


# ------------------------------------------------------------------ least privilege


def _permission_error(js: JetStreamManager) -> str | None:
    """The connection's last permissions violation: a denied API request just times out."""
    nc = getattr(js, "_nc", None)
    last = getattr(nc, "last_error", None)
    text = str(last) if last is not None else ""
    return text if "permissions violation" in text.lower() else None


def _why(js: JetStreamManager, exc: BaseException) -> str:
    denied = _permission_error(js) if isinstance(exc, TimeoutError | NatsTimeout) else None
    return f"denied: {denied}" if denied else one_line(exc, 300)


async def verify(
    js: JetStreamManager,
    streams: Sequence[StreamSpec],
    consumers: Sequence[ConsumerSpec] = (),
    *,
    request_timeout: float = 2.0,
) -> Verification:
    """Check, with info requests only, that every stream and consumer exists.

    Raises ``MissingTopology`` naming each one missing. When even info requests are
    denied (or unanswered), returns a ``Verification`` whose ``reason`` says so and whose
    ``unverified`` lists what could not be checked; the caller decides whether to go on.
    """
    checks: list[tuple[str, str, str | None]] = [("stream", s.name, None) for s in streams]
    checks += [("consumer", c.stream, c.durable) for c in consumers]
    filters = {c.durable: c.filter_subject for c in consumers}
    present: list[str] = []
    missing: list[str] = []
    missing_streams: set[str] = set()
    for index, (kind, stream, durable) in enumerate(checks):
        label = f"{kind} {stream}" + (f"/{durable}" if durable else "")
        if durable and stream in missing_streams:
            missing.append(label)
            continue
        try:
            if durable is None:
                await asyncio.wait_for(js.stream_info(stream), request_timeout)
            else:
                await asyncio.wait_for(js.consumer_info(stream, durable), request_timeout)
        except NotFoundError:
            missing.append(label)
            if durable is None:
                missing_streams.add(stream)
            continue
        except (TimeoutError, NatsTimeout, NoRespondersError) as exc:
            denied = _permission_error(js)
            reason = (
                f"JetStream info requests are denied ({denied})"
                if denied
                else f"JetStream info requests went unanswered ({one_line(exc, 200)})"
            )
            unverified = tuple(f"{k} {s}" + (f"/{d}" if d else "") for k, s, d in checks[index:])
            if missing:
                break
            log.warning("cannot verify topology: %s; unchecked: %s", reason, ", ".join(unverified))
            return Verification(tuple(present), unverified, reason)
        except Exception as exc:  # e.g. JetStream disabled: one line naming the check
            raise TopologyError(f"cannot check {label}: {one_line(exc, 300)}") from exc
        present.append(label)
    if missing:
        absent = [
            filters[label.rpartition("/")[2]] for label in missing if label.startswith("consumer ")
        ]
        raise MissingTopology(
            f"missing JetStream topology: {', '.join(missing)}; run `{fix_command(absent)}` "
            "with an account allowed to create them"
        )
    return Verification(tuple(present))


def fix_command(consumer_filters: Sequence[str]) -> str:
    """The ``meshforge provision`` command that creates the streams and these consumers.

    >>> fix_command(["cmd.acme.*.order.>", "control.cmd.lab1.node7"])
    'meshforge provision --agent order --tenant acme --site lab1 --node node7'
    """
    words = ["meshforge", "provision"]
    agents: list[str] = []
    bound: dict[str, str] = {}
    nodes: list[tuple[str, str]] = []
    for subject in consumer_filters:
        tokens = subject.split(".")
        if tokens[0] == "cmd" and len(tokens) >= 5:
            agents += [tokens[3]] if tokens[3] not in agents else []
            for flag, token in (("--tenant", tokens[1]), ("--namespace", tokens[2])):
                if token != "*":
                    bound[flag] = token
        elif tokens[:2] == ["control", "cmd"] and len(tokens) == 4:
            nodes.append((tokens[2], tokens[3]))
    for agent in agents:
        words += ["--agent", agent]
    for flag, token in bound.items():
        words += [flag, token]
    for site in dict.fromkeys(site for site, _ in nodes):
        words += ["--site", site] + [w for s, n in nodes if s == site for w in ("--node", n)]
    return " ".join(words)
