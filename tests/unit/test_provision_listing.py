"""Paged JetStream listings: reading them ends whatever the server leaves out or repeats.

The pages below follow nats-server's listing rule: entries sorted by name, a page is
``entries[offset:offset + limit]``, and an entry the server cannot describe (a consumer
offline, or closing while another process creates it) is left out of the page but still
counted in the offset and the total.
"""

from __future__ import annotations

import pytest

from meshforge.topology.provision import _list_all


class Listing:
    def __init__(self, entries: list[tuple[str, bool]], limit: int = 256) -> None:
        self.entries = entries  # (name, describable)
        self.limit = limit
        self.calls = 0

    async def fetch(self, offset: int) -> tuple[list[str], int | None]:
        self.calls += 1
        if self.calls > 50:
            raise AssertionError("the listing was asked for more than 50 pages")
        window = self.entries[offset : offset + self.limit]
        return [name for name, ok in window if ok], len(self.entries)

    async def fetch_without_total(self, offset: int) -> tuple[list[str], int | None]:
        page, _ = await self.fetch(offset)
        return page, None


@pytest.mark.parametrize("with_total", [True, False])
async def test_an_entry_left_out_of_the_page_does_not_make_the_listing_loop(
    with_total: bool,
) -> None:
    listing = Listing([("inventory", True), ("order", False), ("shipping", True)])
    fetch = listing.fetch if with_total else listing.fetch_without_total
    assert sorted(set(await _list_all(fetch))) == ["inventory", "shipping"]
    assert listing.calls <= 3


async def test_a_repeated_entry_does_not_make_the_listing_loop() -> None:
    listing = Listing([("order", True), ("order", True), ("shipping", True)])
    assert set(await _list_all(listing.fetch_without_total)) == {"order", "shipping"}
    assert listing.calls <= 3


async def test_every_page_of_a_long_listing_is_read() -> None:
    names = [f"c{i:03d}" for i in range(600)]
    listing = Listing([(n, True) for n in names], limit=256)
    assert await _list_all(listing.fetch) == names
    assert listing.calls == 3  # 256 + 256 + 88, and the total says it is complete
