"""The order checker (see ``test_order_checker.py``) on PostgreSQL: partitioned workers,
and workers sharing one durable (no partitions: any worker may get any resource, so two
commands of one resource in flight at two workers may be applied in either order, as
docs/AGENTS.md says; there the checker holds them to exactly-once only)."""

from __future__ import annotations

from pathlib import Path

import pytest
from order_checker import assert_order_holds

from meshforge.transport.server import EmbeddedServer

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


async def test_each_resource_is_applied_in_stored_order_under_faults_on_postgresql(
    private_server: EmbeddedServer, own_pg: str, tmp_path: Path
) -> None:
    await assert_order_holds(private_server.url, own_pg, tmp_path, seconds=25.0)


async def test_exactly_once_holds_when_workers_share_one_durable(
    private_server: EmbeddedServer, own_pg: str, tmp_path: Path
) -> None:
    await assert_order_holds(private_server.url, own_pg, tmp_path, seconds=12.0, partitions=0)
