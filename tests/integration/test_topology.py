from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType

from meshforge.config import Settings, load_settings
from meshforge.errors import MissingTopology, OverlapError, TopologyError
from meshforge.topology.provision import Action, Plan, apply, ensure, plan, verify
from meshforge.topology.specs import (
    ConsumerSpec,
    StreamSpec,
    agent_consumer,
    default_streams,
    node_consumer,
)
from meshforge.transport.connection import connect
from meshforge.transport.server import EmbeddedServer

NAMES = [
    "MESHFORGE_COMMANDS",
    "MESHFORGE_EVENTS",
    "MESHFORGE_FAILED",
    "MESHFORGE_CONTROL",
    "MESHFORGE_REPLIES",
]


@pytest.fixture
async def empty_js(clean_js: JetStreamContext) -> AsyncIterator[JetStreamContext]:
    """An empty server, emptied again afterwards so no test here leaves streams for others."""
    yield clean_js
    for info in await clean_js.streams_info():
        await clean_js.delete_stream(info.config.name)


def settings(**values: object) -> Settings:
    return load_settings(values, env={})


async def stream_names(js: JetStreamContext) -> set[str]:
    return {info.config.name for info in await js.streams_info()}


def step(planned: Plan, name: str):  # type: ignore[no-untyped-def]
    return next(s for s in planned.steps if s.name == name)


# ------------------------------------------------------------------ specs (no server)


def test_default_streams_follow_the_contract() -> None:
    streams = {s.name: s for s in default_streams(Settings())}
    assert list(streams) == NAMES
    assert streams["MESHFORGE_COMMANDS"].subjects == ("cmd.>",)
    assert streams["MESHFORGE_COMMANDS"].retention == "workqueue"
    assert streams["MESHFORGE_EVENTS"].retention == "limits"
    assert streams["MESHFORGE_FAILED"].subjects == ("failed.>",)
    assert streams["MESHFORGE_CONTROL"].subjects == ("control.cmd.>",)
    assert streams["MESHFORGE_CONTROL"].retention == "workqueue"
    assert streams["MESHFORGE_REPLIES"].subjects == ("control.reply.>",)
    assert all(s.storage == "file" and s.duplicate_window == 120.0 for s in streams.values())


def test_agent_consumer_leaves_the_delivery_limit_to_the_engine() -> None:
    """Held deliveries are not attempts, so the server must not count them."""
    spec = agent_consumer("order", Settings())
    assert spec.durable == "order_consumer"
    assert spec.stream == "MESHFORGE_COMMANDS"
    assert spec.filter_subject == "cmd.*.*.order.>"
    assert spec.max_deliver == -1
    assert spec.backoff == (1.0, 5.0, 10.0, 30.0)


def test_agent_consumer_scoped_to_tenant_and_namespace() -> None:
    assert agent_consumer("order", settings(tenant="acme", namespace="shop")).filter_subject == (
        "cmd.acme.shop.order.>"
    )
    assert agent_consumer("order", Settings(), tenant="t1").filter_subject == "cmd.t1.*.order.>"


def test_agent_consumer_keeps_the_whole_backoff() -> None:
    spec = agent_consumer("order", settings(max_deliver=2))
    assert spec.max_deliver == -1
    assert spec.backoff == (1.0, 5.0, 10.0, 30.0)


def test_node_consumer_is_unlimited_and_without_backoff() -> None:
    spec = node_consumer("lab1", "node7", Settings())
    assert spec.durable == "node_lab1_node7"
    assert spec.stream == "MESHFORGE_CONTROL"
    assert spec.filter_subject == "control.cmd.lab1.node7"
    assert spec.max_deliver == -1
    assert spec.backoff == ()


def test_consumer_spec_refuses_too_long_backoff() -> None:
    with pytest.raises(TopologyError, match="max_deliver"):
        ConsumerSpec("S", "c", "a.>", max_deliver=2, backoff=(1.0, 2.0))


# ------------------------------------------------------------------ plan / apply / ensure


async def test_dry_run_plan_on_empty_server_creates_nothing(empty_js: JetStreamContext) -> None:
    planned = await plan(
        empty_js, default_streams(Settings()), [agent_consumer("order", Settings())]
    )
    assert [s.name for s in planned.steps if s.kind == "stream"] == NAMES
    assert all(s.action is Action.CREATE for s in planned.steps)
    assert "cmd.>" in step(planned, "MESHFORGE_COMMANDS").details
    assert await stream_names(empty_js) == set()


async def test_ensure_twice_changes_nothing_the_second_time(empty_js: JetStreamContext) -> None:
    s = Settings()
    streams = default_streams(s)
    consumers = [
        agent_consumer("order", s),
        agent_consumer("inventory", s),
        node_consumer("lab1", "n1", s),
    ]
    first = await ensure(empty_js, streams, consumers)
    assert first.changed and len(first.applied) == 8
    second = await ensure(empty_js, streams, consumers)
    assert not second.changed
    assert all(st.action is Action.UNCHANGED for st in second.steps)

    commands = await empty_js.stream_info("MESHFORGE_COMMANDS")
    assert commands.config.retention == RetentionPolicy.WORK_QUEUE
    assert commands.config.storage == StorageType.FILE
    assert commands.config.duplicate_window == 120.0
    events = await empty_js.stream_info("MESHFORGE_EVENTS")
    assert events.config.retention == RetentionPolicy.LIMITS
    order = await empty_js.consumer_info("MESHFORGE_COMMANDS", "order_consumer")
    assert order.config.max_deliver == -1
    assert order.config.backoff == [1.0, 5.0, 10.0, 30.0]
    assert order.config.filter_subject == "cmd.*.*.order.>"
    node = await empty_js.consumer_info("MESHFORGE_CONTROL", "node_lab1_n1")
    assert node.config.max_deliver == -1


async def test_duplicate_window_deduplicates(empty_js: JetStreamContext) -> None:
    await ensure(empty_js, default_streams(Settings()))
    a = await empty_js.publish(
        "evt.default.demo.order.created", b"1", headers={"Nats-Msg-Id": "x1"}
    )
    b = await empty_js.publish(
        "evt.default.demo.order.created", b"1", headers={"Nats-Msg-Id": "x1"}
    )
    assert not a.duplicate and b.duplicate


async def test_changed_max_age_is_a_diff_and_updated(empty_js: JetStreamContext) -> None:
    await ensure(empty_js, default_streams(Settings()))
    await empty_js.publish("evt.default.demo.order.created", b"kept")
    changed = default_streams(settings(max_age="2d"))
    planned = await plan(empty_js, changed)
    events = step(planned, "MESHFORGE_EVENTS")
    assert events.action is Action.UPDATE
    assert [(c.field, c.current, c.desired) for c in events.changes] == [
        ("max_age", "unlimited", "2d")
    ]
    assert events.details == "max_age unlimited -> 2d"
    report = await apply(empty_js, planned)
    assert len(report.applied) == 5
    info = await empty_js.stream_info("MESHFORGE_EVENTS")
    assert info.config.max_age == 2 * 86400
    assert info.state.messages == 1  # an update keeps the messages
    assert not (await plan(empty_js, changed)).has_changes


async def test_retention_change_is_refused_with_reason(empty_js: JetStreamContext) -> None:
    await empty_js.add_stream(
        name="MESHFORGE_EVENTS", subjects=["evt.>"], retention=RetentionPolicy.WORK_QUEUE
    )
    planned = await plan(empty_js, default_streams(Settings()))
    events = step(planned, "MESHFORGE_EVENTS")
    assert events.action is Action.REFUSED
    assert "cannot change a stream's retention (retention workqueue -> limits)" in events.reason
    with pytest.raises(
        TopologyError, match="nothing was changed: stream MESHFORGE_EVENTS: JetStream cannot"
    ):
        await apply(empty_js, planned)
    assert await stream_names(empty_js) == {"MESHFORGE_EVENTS"}  # the other four were not created


async def test_storage_change_is_refused(empty_js: JetStreamContext) -> None:
    await ensure(empty_js, default_streams(Settings()))
    planned = await plan(empty_js, default_streams(settings(storage="memory")))
    assert {s.action for s in planned.steps} == {Action.REFUSED}
    assert "storage file -> memory" in planned.steps[0].reason


async def test_overlap_with_an_existing_stream_is_refused_naming_both(
    empty_js: JetStreamContext,
) -> None:
    await empty_js.add_stream(name="OTHER", subjects=["evt.>"])
    planned = await plan(empty_js, default_streams(Settings()))
    events = step(planned, "MESHFORGE_EVENTS")
    assert events.action is Action.REFUSED and events.overlap
    assert "OTHER" in events.reason and "MESHFORGE_EVENTS" in events.reason
    assert step(planned, "MESHFORGE_COMMANDS").action is Action.CREATE
    with pytest.raises(OverlapError) as info:
        await ensure(empty_js, default_streams(Settings()))
    assert "MESHFORGE_EVENTS" in str(info.value) and "OTHER" in str(info.value)
    assert await stream_names(empty_js) == {"OTHER"}


async def test_overlap_between_planned_streams_is_refused(empty_js: JetStreamContext) -> None:
    extra = StreamSpec("AUDIT", ("evt.default.>",))
    planned = await plan(empty_js, [*default_streams(Settings()), extra])
    audit = step(planned, "AUDIT")
    assert audit.action is Action.REFUSED and "MESHFORGE_EVENTS" in audit.reason
    assert "AUDIT" in step(planned, "MESHFORGE_EVENTS").reason
    with pytest.raises(OverlapError):
        await apply(empty_js, planned)


async def test_consumer_changes_are_diffs(empty_js: JetStreamContext) -> None:
    """An agent durable provisioned before held deliveries were counted by the engine
    (MaxDeliver max_deliver + 1, backoff trimmed) is updated in place."""
    old = replace(agent_consumer("order", Settings()), max_deliver=4, backoff=(1.0, 5.0, 10.0))
    await ensure(empty_js, default_streams(Settings()), [old])
    planned = await plan(
        empty_js, default_streams(Settings()), [agent_consumer("order", Settings())]
    )
    order = step(planned, "MESHFORGE_COMMANDS/order_consumer")
    assert order.action is Action.UPDATE
    assert order.details == "max_deliver 4 -> unlimited; backoff 1s,5s,10s -> 1s,5s,10s,30s"
    await apply(empty_js, planned)
    info = await empty_js.consumer_info("MESHFORGE_COMMANDS", "order_consumer")
    assert info.config.max_deliver == -1
    assert info.config.backoff == [1.0, 5.0, 10.0, 30.0]


async def test_consumer_deliver_policy_change_is_refused(empty_js: JetStreamContext) -> None:
    await ensure(empty_js, default_streams(Settings()))
    config = ConsumerConfig(
        durable_name="reader", deliver_policy=DeliverPolicy.NEW, filter_subject="evt.>"
    )
    await empty_js.add_consumer("MESHFORGE_EVENTS", config)
    spec = ConsumerSpec("MESHFORGE_EVENTS", "reader", "evt.>")
    planned = await plan(empty_js, default_streams(Settings()), [spec])
    assert "deliver_policy new -> all" in step(planned, "MESHFORGE_EVENTS/reader").reason


async def test_overlapping_consumer_on_work_queue_is_refused(empty_js: JetStreamContext) -> None:
    await ensure(empty_js, default_streams(Settings()))
    await empty_js.add_consumer(
        "MESHFORGE_COMMANDS", ConsumerConfig(durable_name="all_cmds", filter_subject="cmd.>")
    )
    planned = await plan(
        empty_js, default_streams(Settings()), [agent_consumer("order", Settings())]
    )
    order = step(planned, "MESHFORGE_COMMANDS/order_consumer")
    assert order.action is Action.REFUSED
    assert "all_cmds" in order.reason and "order_consumer" in order.name


async def test_consumer_outside_stream_or_on_unknown_stream_is_refused(
    empty_js: JetStreamContext,
) -> None:
    bad_filter = ConsumerSpec("MESHFORGE_EVENTS", "wrong", "cmd.>")
    unknown = ConsumerSpec("NOPE", "c", "x.>")
    planned = await plan(empty_js, default_streams(Settings()), [bad_filter, unknown])
    assert "outside stream MESHFORGE_EVENTS" in step(planned, "MESHFORGE_EVENTS/wrong").reason
    assert "NOPE neither exists nor is planned" in step(planned, "NOPE/c").reason


async def test_failure_half_way_says_what_was_done(empty_js: JetStreamContext) -> None:
    streams = [
        StreamSpec("HALF_A", ("half-a.>",)),
        StreamSpec("HALF_B", ("half-b.>",), replicas=3),
        StreamSpec("HALF_C", ("half-c.>",)),
    ]
    with pytest.raises(TopologyError) as info:
        await ensure(empty_js, streams)
    message = str(info.value)
    assert "create stream HALF_B failed" in message
    assert "done: create stream HALF_A;" in message
    assert "not done: create stream HALF_B, create stream HALF_C" in message
    assert "\n" not in message
    assert await stream_names(empty_js) == {"HALF_A"}


async def test_a_one_attempt_agent_consumer_is_accepted_by_the_server(
    empty_js: JetStreamContext,
) -> None:
    s = settings(max_deliver=1)
    report = await ensure(empty_js, default_streams(s), [agent_consumer("tiny", s)])
    assert report.changed
    info = await empty_js.consumer_info("MESHFORGE_COMMANDS", "tiny_consumer")
    assert info.config.max_deliver == -1 and info.config.backoff == [1.0, 5.0, 10.0, 30.0]


# ------------------------------------------------------------------ verify (least privilege)


async def test_verify_lists_everything_missing(empty_js: JetStreamContext) -> None:
    with pytest.raises(MissingTopology) as info:
        await verify(empty_js, default_streams(Settings()), [agent_consumer("order", Settings())])
    message = str(info.value)
    for name in NAMES:
        assert f"stream {name}" in message
    assert "consumer MESHFORGE_COMMANDS/order_consumer" in message


async def test_verify_after_ensure(empty_js: JetStreamContext) -> None:
    consumers = [agent_consumer("order", Settings())]
    await ensure(empty_js, default_streams(Settings()), consumers)
    result = await verify(empty_js, default_streams(Settings()), consumers)
    assert result.complete and len(result.present) == 6
    with pytest.raises(
        MissingTopology,
        match=r"missing JetStream topology: consumer MESHFORGE_COMMANDS/ghost_consumer;",
    ):
        await verify(
            empty_js, default_streams(Settings()), [*consumers, agent_consumer("ghost", Settings())]
        )


AUTH = """
authorization {
  users = [
    {user: admin, password: admin}
    {user: reader, password: reader, permissions: {
      publish: {allow: ["cmd.>", "$JS.API.STREAM.INFO.>", "$JS.API.CONSUMER.INFO.>"]},
      subscribe: {allow: ["_INBOX_reader.>"]}}}
    {user: locked, password: locked, permissions: {
      publish: {allow: ["cmd.>"]}, subscribe: {allow: ["_INBOX_locked.>"]}}}
  ]
}
"""


async def test_verify_with_restricted_permissions(tmp_path: Path) -> None:
    conf = tmp_path / "auth.conf"
    conf.write_text(AUTH)
    s = Settings()
    streams, consumers = default_streams(s), [agent_consumer("order", s)]
    async with EmbeddedServer(store_dir=tmp_path / "nats", extra_args=["-c", str(conf)]) as server:

        def as_user(name: str) -> Settings:
            return settings(user=name, password=name, connect_attempts=1)

        async with await connect(as_user("admin"), url=server.url) as admin:
            assert (await ensure(admin.js, streams, consumers)).changed
        async with await connect(as_user("reader"), url=server.url) as reader:
            assert (await verify(reader.js, streams, consumers)).complete
            with pytest.raises(MissingTopology, match="consumer MESHFORGE_COMMANDS/late_consumer"):
                await verify(reader.js, streams, [agent_consumer("late", s)], request_timeout=1)
            with pytest.raises(TopologyError, match="cannot read the JetStream topology: denied"):
                await plan(reader.nc.jetstream(timeout=0.5), streams, consumers)
        async with await connect(as_user("locked"), url=server.url) as locked:
            result = await verify(locked.js, streams, consumers, request_timeout=0.5)
            assert not result.complete
            assert "denied" in result.reason and "permissions violation" in result.reason
            assert len(result.unverified) == 6
