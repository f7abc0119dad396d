"""The ``durability`` setting: what a store commit survives is chosen by name, and each
backend's own switch follows it on the connection that commits the effects."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine_support import running, settings_for

from meshforge.config import load_settings
from meshforge.demo import OrderAgent
from meshforge.errors import ConfigError
from meshforge.store import open_store

# What each backend's switch reads back, inside a store transaction, per durability.
_SQLITE = {"sync": 2, "os": 1}  # PRAGMA synchronous: 2 FULL, 1 NORMAL
_POSTGRES = {"sync": "on", "os": "off"}  # SHOW synchronous_commit


@pytest.mark.parametrize("durability", ["sync", "os"])
def test_the_committing_connection_follows_durability(own_store_url: str, durability: str) -> None:
    with open_store(own_store_url, durability=durability) as store:  # type: ignore[arg-type]
        for _ in range(3):  # every pooled connection a transaction may take
            with store.transaction() as tx:
                if own_store_url.startswith("sqlite"):
                    assert tx.execute("PRAGMA synchronous") == [(_SQLITE[durability],)]
                else:
                    assert tx.execute("SHOW synchronous_commit") == [(_POSTGRES[durability],)]


def test_the_default_is_sync(tmp_path: Path) -> None:
    assert load_settings({}).durability == "sync"
    with open_store(f"sqlite:///{tmp_path / 's.db'}") as store, store.transaction() as tx:
        assert tx.execute("PRAGMA synchronous") == [(2,)]


def test_durability_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHFORGE_DURABILITY", "os")
    assert load_settings({}).durability == "os"
    monkeypatch.setenv("MESHFORGE_DURABILITY", "fast")
    with pytest.raises(ConfigError, match="MESHFORGE_DURABILITY") as info:
        load_settings({})
    assert "\n" not in str(info.value) and "sync" in str(info.value)


def test_the_url_option_may_not_contradict_durability(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}?synchronous=normal"
    with pytest.raises(ConfigError, match="set durability = os") as info:
        open_store(url)
    assert "\n" not in str(info.value)
    with open_store(url, durability="os") as store, store.transaction() as tx:
        assert tx.execute("PRAGMA synchronous") == [(1,)]


def test_an_unknown_durability_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="durability must be sync or os"):
        open_store(f"sqlite:///{tmp_path / 's.db'}", durability="fast")  # type: ignore[arg-type]


async def test_a_worker_opens_its_store_with_the_setting(nats_url: str, tmp_path: Path) -> None:
    settings = settings_for(nats_url, f"sqlite:///{tmp_path / 's.db'}", durability="os")
    async with running([OrderAgent()], settings) as worker:
        store = worker._store  # the store the worker opened itself, from its settings
        assert store is not None
        with store.transaction() as tx:
            assert tx.execute("PRAGMA synchronous") == [(_SQLITE["os"],)]
