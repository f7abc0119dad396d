"""`meshforge permissions`: what each role may do, and clear errors for bad options."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.config import Settings
from meshforge.errors import ConfigError
from meshforge.permissions import role_grant


def test_tenant_narrows_what_an_agent_and_a_publisher_may_publish() -> None:
    agent = role_grant("agent", Settings(), agents=["order"], tenant="acme")
    assert "evt.acme.*.order.>" in agent.publish and "cmd.acme.*.>" in agent.publish
    assert not any(s in agent.publish for s in ("cmd.>", "evt.>", "failed.>"))
    assert "$JS.API.INFO" in agent.publish and agent.subscribe == ("_INBOX.>",)
    assert role_grant("publisher", tenant="acme").publish == ("$JS.API.INFO", "cmd.acme.>", "evt.acme.>")
    assert role_grant("publisher", subjects=["cmd.acme.shop.>"]).publish == ("$JS.API.INFO", "cmd.acme.shop.>")


def test_a_partitioned_agent_pulls_and_unpins_its_partition_durables_only() -> None:
    grant = role_grant("agent", Settings(partitions=2), agents=["order"], tenant="acme")
    durables = ["order_consumer_acme_all_p0", "order_consumer_acme_all_p1", "order_consumer_acme_all_unpartitioned"]
    for durable in durables:
        assert f"$JS.API.CONSUMER.MSG.NEXT.MESHFORGE_COMMANDS.{durable}" in grant.publish
        assert f"$JS.API.CONSUMER.UNPIN.MESHFORGE_COMMANDS.{durable}" in grant.publish
    assert not any(s.endswith(".order_consumer_acme_all") for s in grant.publish)  # not the plain durable
    assert "$KV.MESHFORGE_PARTITIONS.lease.order_consumer_acme_all.*" in grant.publish
    assert not any("UNPIN" in s for s in role_grant("agent", Settings(), agents=["order"]).publish)


def test_no_role_gets_the_whole_api_but_admin() -> None:
    grants = {
        "agent": role_grant("agent", agents=["a"]),
        "node": role_grant("node", site="s", nodes=["n"]),
        "publisher": role_grant("publisher"),
        "spark": role_grant("spark", writes=["evt.x.>"]),
    }
    for role, grant in grants.items():
        assert not any(s in ("$JS.API.>", ">") for s in grant.publish), role
        assert all(s for s in grant.publish), role  # an empty allow list would allow everything


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["agent"], "permissions agent: name the agents with --agent NAME"),
        (["node", "--site", "lab1"], "permissions node: give --site SITE and --node NODE"),
        (["agent", "--agent", "bad.name"], "agent name"),
    ],
)
def test_missing_or_bad_options_are_one_line(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CliRunner().invoke(app, ["permissions", *args], catch_exceptions=False)


def test_unknown_role_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["permissions", "root"])
    assert result.exit_code == 2 and "unknown role 'root'; roles: admin, agent, node, publisher, spark, leaf" in result.output
