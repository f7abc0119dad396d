"""CONTROL_PLANE.md: the hub does not advertise other leafnode URLs, so a site dials only
the address it was given."""

from __future__ import annotations

from meshforge.control.sites import server_config


def test_the_hub_listens_for_leaf_nodes_without_advertising_other_urls() -> None:
    hub = server_config(domain="hub", leaf_listen="0.0.0.0:7422")
    assert 'leafnodes { listen: "0.0.0.0:7422", no_advertise: true' in hub
    site = server_config(domain="plant3", hub_url="nats-leaf://hub.example:7422")
    assert "no_advertise" not in site  # a site listens for no leaf nodes


def test_a_site_dials_its_hub_again_within_a_second_of_a_cut() -> None:
    """CONTROL_PLANE.md "When the link returns": nats-server's default is 1 s plus up to 1 s."""
    site = server_config(domain="plant3", hub_url="nats-leaf://hub.example:7422")
    assert 'leafnodes { reconnect: "500ms", remotes: [' in site
