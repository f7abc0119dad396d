"""Per-resource order under faults, checked by a model (``order_checker.py``): a random
seeded workload over 50 resources with transient failures, ``Retry``, slow handlers and
dead letters, while 2-3 workers are killed (SIGKILL), stalled (SIGSTOP past their
partition lease), stopped gracefully with work in flight and started again, so
partitions are taken over and handed back; judged per resource from the streams and the
store (``order_oracle.py``).

``make test`` runs 40 s of workload per store (20 s with the workers sharing one durable
instead of partitions); ``CHAOS_SCALE`` (``make chaos``: 10) multiplies it.
``ORDER_CHECKER_SEED`` replays a failing seed (printed with the violation).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from order_checker import checked_run, report, scale, seed_from_env

from meshforge.server import EmbeddedServer

pytestmark = pytest.mark.slow


def store_url(store: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if store == "postgresql":
        url: str = request.getfixturevalue("own_pg")
        return url
    return f"sqlite:///{tmp_path / 'store.db'}?busy_timeout=30000"


@pytest.mark.parametrize(
    ("store", "partitions", "seconds"),
    [("sqlite", 3, 40.0), pytest.param("postgresql", 3, 40.0, marks=pytest.mark.postgres),
     pytest.param("postgresql", 0, 20.0, marks=pytest.mark.postgres, id="postgresql-shared-durable")],
)  # fmt: skip
async def test_each_resource_is_applied_in_stored_order_under_faults(
    store: str, partitions: int, seconds: float, private_server: EmbeddedServer, tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    url = store_url(store, tmp_path, request)
    run, outcome = await checked_run(private_server.url, url, tmp_path, seed=seed_from_env(),
                                     seconds=seconds * scale(), partitions=partitions)  # fmt: skip
    verdict = report(run, outcome)
    print(verdict)
    assert outcome.ok, verdict
    assert sum(run.faults.values()) >= 5, f"too few faults to mean anything: {verdict}"


async def test_the_checker_passes_a_run_without_transient_failures_or_worker_faults(
    private_server: EmbeddedServer, tmp_path: Path
) -> None:
    """The checker's control: slow handlers and dead letters only, which keep order today."""
    run, outcome = await checked_run(private_server.url, f"sqlite:///{tmp_path / 'store.db'}", tmp_path,
                                     seed=seed_from_env(), seconds=10.0, calm=True)  # fmt: skip
    verdict = report(run, outcome)
    assert outcome.ok, verdict
    assert outcome.applied > 100 and not run.faults
