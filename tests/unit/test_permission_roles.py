"""`meshforge permissions`: what each role may do, and clear errors for bad options."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.config import Settings
from meshforge.errors import ConfigError
from meshforge.topology.permissions import User, authorization_block, role_grant


def test_tenant_narrows_what_an_agent_and_a_publisher_may_publish() -> None:
    agent = role_grant("agent", Settings(), agents=["order"], tenant="acme")
    assert "evt.acme.*.order.>" in agent.publish and "cmd.acme.*.>" in agent.publish
    assert not any(s in agent.publish for s in ("cmd.>", "evt.>", "failed.>"))
    assert "$JS.API.INFO" in agent.publish and agent.subscribe == ()
    assert role_grant("publisher", tenant="acme").publish == ("$JS.API.INFO", "cmd.acme.>")
    assert role_grant("publisher", subjects=["evt.acme.>"]).publish == (
        "$JS.API.INFO",
        "evt.acme.>",
    )
    assert role_grant("publisher", subjects=["cmd.acme.shop.>"]).publish == (
        "$JS.API.INFO",
        "cmd.acme.shop.>",
    )


def test_a_partitioned_agent_pulls_and_unpins_its_partition_durables_only() -> None:
    grant = role_grant("agent", Settings(partitions=2), agents=["order"], tenant="acme")
    durables = [
        "order_consumer_acme_all_p0",
        "order_consumer_acme_all_p1",
        "order_consumer_acme_all_unpartitioned",
    ]
    for durable in durables:
        assert f"$JS.API.CONSUMER.MSG.NEXT.MESHFORGE_COMMANDS.{durable}" in grant.publish
        assert f"$JS.API.CONSUMER.UNPIN.MESHFORGE_COMMANDS.{durable}" in grant.publish
    assert not any(
        s.endswith(".order_consumer_acme_all") for s in grant.publish
    )  # not the plain durable
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
        assert grant.publish, role  # an empty allow list would allow everything
        assert all(s for s in grant.publish), role  # and every entry names a subject


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
    assert (
        result.exit_code == 2
        and "unknown role 'root'; roles: admin, agent, node, publisher, spark, leaf"
        in result.output
    )


def test_each_user_subscribes_to_its_own_reply_inbox_only() -> None:
    """Issue 29: `_INBOX.>` let every user read every other user's pulled commands."""
    result = CliRunner().invoke(app, ["permissions", "admin", "agent", "node", "publisher", "spark",
                                      "--agent", "order", "--site", "s", "--node", "n"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert '"_INBOX.>"' not in result.output
    for role in ("admin", "agent", "node", "publisher", "spark"):
        assert f'"_INBOX_meshforge-{role}.>"' in result.output
    pub = CliRunner().invoke(
        app, ["permissions", "publisher", "--user", "acme.pub", "--tenant", "acme"]
    )
    assert '"_INBOX_acme_pub.>"' in pub.output and "evt." not in pub.output
    own = CliRunner().invoke(app, ["permissions", "spark", "--inbox-prefix", "_INBOX_pipeline"])
    assert '"_INBOX_pipeline.>"' in own.output and "_INBOX_meshforge" not in own.output


def test_two_users_sharing_a_reply_inbox_or_a_bad_prefix_are_refused() -> None:
    grant = role_grant("publisher")
    with pytest.raises(
        ConfigError, match=re.escape("'a.b' and 'a_b' would share the reply inbox '_INBOX_a_b.>'")
    ):
        authorization_block([User("a.b", grant), User("a_b", grant)])
    with pytest.raises(ConfigError, match="inbox prefix of 'x'"):
        authorization_block([User("x", grant, inbox_prefix="_INBOX.*")])
    result = CliRunner().invoke(app, ["permissions", "admin", "spark", "--inbox-prefix", "_I"])
    assert result.exit_code == 2 and "exactly one ROLE" in result.output
