"""The subject names the tenant; header and body may only agree with it."""

from __future__ import annotations

from meshforge.envelope import H_TENANT, Envelope, decode
from meshforge.topology.scope import DEFAULT_SCOPE, Scope, command_scope, tenant_conflict
from meshforge.topology.specs import agent_durable


def test_scope_of_a_subject() -> None:
    assert Scope.of_subject("cmd.acme.shop.order.create") == Scope("acme", "shop")
    assert Scope.of_subject("evt.acme.shop.order.created") == Scope("acme", "shop")
    for subject in ("cmd.acme.order.create", "control.cmd.a.b.c", "cmd..shop.a.b", "", None):
        assert Scope.of_subject(subject) is None
    assert command_scope("other.subject", "acme") == Scope("acme", "default")
    assert command_scope(None) == DEFAULT_SCOPE


def test_a_claim_of_another_tenant_is_a_one_line_conflict() -> None:
    scope = Scope("tenantA", "demo")
    assert tenant_conflict(scope, header="tenantA", body="tenantA") is None
    assert tenant_conflict(scope, header=None, body=None) is None
    assert tenant_conflict(scope, header="", body=None) is None
    header = tenant_conflict(scope, header="tenantB", body=None)
    assert header is not None and "Tenant-Id header 'tenantB'" in header and "'tenantA'" in header
    body = tenant_conflict(scope, header="tenantA", body="x\ny" * 100)
    assert body is not None and body.startswith("body tenant_id") and "\n" not in body
    assert len(body) < 250


def test_the_decoder_keeps_the_body_tenant_beside_the_header() -> None:
    env = Envelope.new("order.create", {}, tenant_id="tenantB")
    back = decode(env.encode(), {**env.headers(), H_TENANT: "tenantA"})
    assert (back.tenant_id, back.body_tenant_id) == ("tenantA", "tenantB")
    assert "body_tenant_id" not in back.to_dict()
    plain = decode(Envelope.new("order.create", {}).encode().replace(b'"default"', b'""'))
    assert plain.body_tenant_id is None


def test_bound_workers_have_their_own_durable_names() -> None:
    assert agent_durable("order") == "order_consumer"
    assert agent_durable("order", "tenantA") == "order_consumer_tenantA_all"
    assert agent_durable("order", "tenantA", "shop") == "order_consumer_tenantA_shop"
    assert agent_durable("order", "*", "shop") == "order_consumer_all_shop"
