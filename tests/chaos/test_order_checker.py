"""Per-resource order under faults, checked by a model (``order_checker.py``): a random
seeded workload over 50 resources with transient failures, ``Retry``, slow handlers and
dead letters, while 2-3 partitioned workers are killed (SIGKILL), stalled (SIGSTOP past
their lease), stopped gracefully with work in flight and started again, so partitions
are taken over and handed back; judged per resource from the streams and the store
(``order_oracle.py``). This file: SQLite; ``test_order_checker_pg.py``: PostgreSQL.

``make test`` runs 25 s of workload per store (about 16 faults); ``CHAOS_SCALE``
(``make chaos``: 20) multiplies it. ``ORDER_CHECKER_SEED`` replays a failing seed (printed with the violation).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from order_checker import assert_order_holds, checked_run, report, seed_from_env

from meshforge.transport.server import EmbeddedServer

pytestmark = pytest.mark.slow


async def test_each_resource_is_applied_in_stored_order_under_faults_on_sqlite(
    private_server: EmbeddedServer, tmp_path: Path
) -> None:
    store = f"sqlite:///{tmp_path / 'store.db'}?busy_timeout=30000"
    await assert_order_holds(private_server.url, store, tmp_path, seconds=25.0)


async def test_the_checker_passes_a_run_without_transient_failures_or_worker_faults(
    private_server: EmbeddedServer, tmp_path: Path
) -> None:
    """The checker's control: slow handlers and dead letters only, which keep order today."""
    run, outcome = await checked_run(private_server.url, f"sqlite:///{tmp_path / 'store.db'}", tmp_path,
                                     seed=seed_from_env(), seconds=10.0, calm=True)  # fmt: skip
    verdict = report(run, outcome)
    assert outcome.ok, verdict
    assert outcome.applied > 100 and not run.faults
