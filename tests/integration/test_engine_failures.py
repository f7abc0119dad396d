"""Bad input and failing handlers: dead letters with the right reason, naks, timeouts, store errors."""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import msgspec
import pytest
from test_engine_support import (
    SCOPE,
    Account,
    consumer_idle,
    dead_letters_of,
    events_of,
    ledger_agent,
    open_conn,
    open_store_async,
    running,
    send,
    send_many,
    settings_for,
    wait_until,
)

from meshforge.demo import OrderAgent
from meshforge.envelope import Envelope
from meshforge.errors import StoreError
from meshforge.runtime import Agent, Event, Output, command
from meshforge.runtime.worker import Worker
from meshforge.store import Store, Transaction
from meshforge.transport.server import EmbeddedServer


def reasons(letters: list[Any]) -> dict[str, tuple[str, str]]:
    """Dead letters by original message id: (reason, error)."""
    out = {}
    for m in letters:
        env = m.envelope()
        out[env.id] = (m.headers.get("Dlq-Reason", ""), m.headers.get("Dlq-Error", ""))
    return out


async def test_bad_commands_are_dead_lettered_and_the_worker_goes_on(
    nats_url: str, sqlite_url: str
) -> None:
    agent = ledger_agent()
    settings = settings_for(nats_url, sqlite_url)
    conn = await open_conn(settings)
    store = await open_store_async(sqlite_url)
    try:
        async with running([agent], settings, store=store):
            unknown = await send(conn, agent.name, "explode", {"account": "a"})
            invalid = await send(
                conn, agent.name, "credit", {"account": "a", "amount": -1, "mode": "invalid"}
            )
            missing = await send(
                conn, agent.name, "credit", {"account": "a", "amount": 1, "mode": "missing"}
            )
            no_key = await send(conn, agent.name, "credit", {"amount": 1})
            wrong_type = await send(conn, agent.name, "credit", {"account": "a", "amount": "lots"})
            good = await send(conn, agent.name, "credit", {"account": "a", "amount": 2})
            await wait_until(lambda: consumer_idle(conn, agent.name))
            letters = reasons(await dead_letters_of(conn, agent.name))
        assert (
            letters[unknown.id][0] == "unrecoverable"
            and "unknown command" in letters[unknown.id][1]
        )
        assert letters[invalid.id] == (
            "unrecoverable",
            "ValueError: amount must be positive, got -1",
        )
        assert letters[missing.id][0] == "unrecoverable" and "KeyError" in letters[missing.id][1]
        assert (
            letters[no_key.id][0] == "unrecoverable" and "lacks 'account'" in letters[no_key.id][1]
        )
        assert (
            letters[wrong_type.id][0] == "unrecoverable"
            and "ValueError" in letters[wrong_type.id][1]
        )
        assert good.id not in letters and len(letters) == 5
        events = [m.envelope() for m in await events_of(conn, agent.name)]
        assert [e.causation_id for e in events if e] == [good.id]
        with store.transaction() as tx:
            state = msgspec.json.decode(
                tx.state_get(agent.name, "a", scope=SCOPE) or b"", type=Account
            )
        assert state == Account(
            balance=2, history=[2]
        )  # the failed handlers' in-place edits undone
    finally:
        store.close()
        await conn.close()


async def test_transient_failure_naks_it_and_later_same_resource_commands(
    nats_url: str, sqlite_url: str
) -> None:
    agent = ledger_agent()
    settings = settings_for(nats_url, sqlite_url, batch_size=16)
    conn = await open_conn(settings)
    try:
        subject = f"cmd.default.test.{agent.name}.credit"
        flaky = Envelope.new(
            f"{agent.name}.credit", {"account": "a", "amount": 1, "mode": "flaky", "times": 2}
        )
        after = [
            Envelope.new(f"{agent.name}.credit", {"account": "a", "amount": 10 + i})
            for i in range(3)
        ]
        other = Envelope.new(f"{agent.name}.credit", {"account": "b", "amount": 7})
        await send_many(conn, [(subject, e) for e in (flaky, *after, other)])
        async with running([agent], settings):
            await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
        events = [m.envelope() for m in await events_of(conn, agent.name)]
        by_account: dict[str, list[int]] = {}
        for e in events:
            assert e is not None
            by_account.setdefault(e.payload["account"], []).append(e.payload["amount"])
        assert by_account["a"] == [1, 10, 11, 12]  # still in stream order after two naks
        assert by_account["b"] == [7]
        seen_a = [balance for cmd_id, balance in agent.calls if cmd_id in {e.id for e in after}]  # type: ignore[attr-defined]
        assert seen_a[-3:] == [1, 11, 22]
        assert not await dead_letters_of(conn, agent.name)
    finally:
        await conn.close()


async def test_persistent_bug_ends_as_max_deliveries(nats_url: str, sqlite_url: str) -> None:
    agent = ledger_agent()
    settings = settings_for(nats_url, sqlite_url, max_deliver=3)
    conn = await open_conn(settings)
    try:
        async with running([agent], settings):
            bug = await send(
                conn, agent.name, "credit", {"account": "a", "amount": 1, "mode": "bug"}
            )
            await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
            letters = reasons(await dead_letters_of(conn, agent.name))
        assert letters[bug.id][0] == "max_deliveries"
        assert "ZeroDivisionError" in letters[bug.id][1]
        assert sum(1 for cmd_id, _ in agent.calls if cmd_id == bug.id) == 3  # type: ignore[attr-defined]
    finally:
        await conn.close()


async def test_handler_timeout_is_transient(nats_url: str, sqlite_url: str) -> None:
    agent = ledger_agent()
    settings = settings_for(nats_url, sqlite_url, max_deliver=2)
    conn = await open_conn(settings)
    try:
        async with running([agent], settings) as worker:
            for engine in worker._engines:
                engine.handler_timeout = 0.2
            slow = await send(
                conn,
                agent.name,
                "credit",
                {"account": "a", "amount": 1, "mode": "slow", "seconds": 5},
            )
            fast = await send(
                conn,
                agent.name,
                "credit",
                {"account": "b", "amount": 1, "mode": "slow", "seconds": 0.01},
            )
            await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
            letters = reasons(await dead_letters_of(conn, agent.name))
        assert letters[slow.id][0] == "max_deliveries" and "timed out" in letters[slow.id][1]
        assert fast.id not in letters
        assert sum(1 for cmd_id, _ in agent.calls if cmd_id == slow.id) == 2  # type: ignore[attr-defined]
    finally:
        await conn.close()


async def test_retry_with_delay_runs_again(nats_url: str, sqlite_url: str) -> None:
    agent = ledger_agent()
    settings = settings_for(nats_url, sqlite_url)
    conn = await open_conn(settings)
    try:
        async with running([agent], settings):
            cmd = await send(
                conn, agent.name, "credit", {"account": "a", "amount": 4, "mode": "retry"}
            )
            await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
        events = [m.envelope() for m in await events_of(conn, agent.name)]
        assert [e.causation_id for e in events if e] == [cmd.id]
        assert sum(1 for cmd_id, _ in agent.calls if cmd_id == cmd.id) == 2  # type: ignore[attr-defined]
    finally:
        await conn.close()


class FlakyStore:
    """The real store, whose next ``fail`` commits raise a retriable (or given) StoreError;
    ``fail_now`` does the same to the commits of ``transaction_now`` (SQLite's transactions
    on the event loop), which the real store begins as it would."""

    def __init__(self, store: Store, fail: int, error: StoreError, fail_now: int = 0) -> None:
        self._store = store
        self.fail = fail
        self.fail_now = fail_now
        self.failed_now = 0  # commits failed on the event loop
        self.error = error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def transaction(self) -> AbstractContextManager[Transaction]:
        @contextmanager
        def tx() -> Iterator[Transaction]:
            with self._store.transaction() as inner:
                yield inner
                if self.fail > 0:  # fails as a commit would: everything rolls back
                    self.fail -= 1
                    raise self.error

        return tx()

    def transaction_now(self) -> tuple[AbstractContextManager[Transaction], Transaction] | None:
        begun = self._store.transaction_now()
        if begun is None:
            return None
        real, inner = begun
        flaky = self

        class Commit(AbstractContextManager[Transaction]):
            def __enter__(self) -> Transaction:
                return inner

            def __exit__(self, *exc: Any) -> None:
                if exc[0] is None and flaky.fail_now > 0:  # a failing COMMIT: rolled back
                    flaky.fail_now -= 1
                    flaky.failed_now += 1
                    error = flaky.error
                    real.__exit__(type(error), error, error.__traceback__)
                    raise error
                real.__exit__(*exc)

        return Commit(), inner


async def test_store_errors_nak_the_batch_and_nothing_is_half_done(
    nats_url: str, sqlite_url: str
) -> None:
    for error, times in (
        (StoreError("could not serialize access", kind="conflict", retriable=True), 6),
        (StoreError("disk I/O error", kind="error"), 2),
    ):
        agent = ledger_agent()
        settings = settings_for(nats_url, sqlite_url)
        conn = await open_conn(settings)
        real = await open_store_async(sqlite_url)
        flaky = FlakyStore(real, fail=times, error=error)
        try:
            async with running([agent], settings, store=flaky):  # type: ignore[arg-type]
                cmds = [
                    await send(conn, agent.name, "credit", {"account": "a", "amount": i})
                    for i in range(1, 4)
                ]
                await wait_until(lambda a=agent, c=conn: consumer_idle(c, a.name), within=30)  # type: ignore[misc]
            assert flaky.fail == 0
            events = [m.envelope() for m in await events_of(conn, agent.name)]
            assert sorted(e.causation_id for e in events if e) == sorted(c.id for c in cmds)
            assert len(list(real.events_read(agent.name, scope=SCOPE))) == 3
            with real.transaction() as tx:
                state = msgspec.json.decode(
                    tx.state_get(agent.name, "a", scope=SCOPE) or b"", type=Account
                )
            assert state.balance == 6
            assert not await dead_letters_of(conn, agent.name)
        finally:
            real.close()
            await conn.close()


def plain_ledger() -> Agent[Account]:
    """A ledger whose handler is a plain function: SQLite runs its transactions on the loop."""

    class PlainLedger(Agent[Account]):
        name = f"pled{uuid.uuid4().hex[:8]}"

        @command("credit", key="account")
        def credit(self, cmd: Envelope, state: Account) -> list[Output]:
            return [Event("credited", {"amount": int(cmd.payload["amount"])})]

        def apply(self, state: Account, event: Event) -> Account:
            return Account(balance=state.balance + int(event.payload["amount"]))

    return PlainLedger()


@pytest.mark.parametrize(
    "error",
    [
        StoreError("database is locked", kind="busy", retriable=True),
        StoreError("disk I/O error", kind="error"),
    ],
    ids=["retriable", "not-retriable"],
)
async def test_a_failing_commit_on_the_event_loop_naks_and_nothing_is_half_done(
    nats_url: str, sqlite_url: str, error: StoreError
) -> None:
    agent = plain_ledger()
    settings = settings_for(nats_url, sqlite_url)
    conn = await open_conn(settings)
    real = await open_store_async(sqlite_url)
    flaky = FlakyStore(real, fail=0, error=error, fail_now=1)

    async def settled() -> bool:
        return flaky.failed_now > 0 or await consumer_idle(conn, agent.name)

    async def credit() -> Envelope:
        return await send(conn, agent.name, "credit", {"account": "a", "amount": 1})

    try:
        async with running([agent], settings, store=flaky):  # type: ignore[arg-type]
            # A lone command on an idle engine runs its transaction on the loop, unless
            # the store is busy that instant: send them one by one until one did.
            sent: list[Envelope] = []
            while flaky.failed_now == 0:
                assert len(sent) < 50, "no transaction ran on the event loop"
                sent.append(await credit())
                await wait_until(settled, within=30, what="the command handled or failed")
            sent += [await credit(), await credit()]  # and the worker goes on
            await wait_until(lambda: consumer_idle(conn, agent.name), within=30)
        assert flaky.failed_now == 1
        events = [m.envelope() for m in await events_of(conn, agent.name)]
        assert sorted(e.causation_id for e in events if e) == sorted(c.id for c in sent)
        assert len(list(real.events_read(agent.name, scope=SCOPE))) == len(sent)
        with real.transaction() as tx:
            state = msgspec.json.decode(
                tx.state_get(agent.name, "a", scope=SCOPE) or b"", type=Account
            )
        assert state.balance == len(sent)
        assert not await dead_letters_of(conn, agent.name)
    finally:
        real.close()
        await conn.close()


async def test_a_worker_told_to_stop_while_it_cannot_reach_nats_stops_at_once(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = settings_for(
        f"nats://127.0.0.1:{port}", sqlite_url, connect_attempts=100, connect_timeout=1.0
    )
    caplog.set_level(logging.INFO, logger="meshforge.connection")
    worker = Worker([ledger_agent()], settings)
    run = asyncio.create_task(worker.run())
    await wait_until(lambda: "(attempt 1 of 100)" in caplog.text, what="a failed connect attempt")
    await worker.stop()
    await asyncio.wait_for(run, 5)  # 100 attempts with backoff would take minutes
    assert not worker.ready.is_set()


@pytest.mark.parametrize("store_kind", ["sqlite", "postgresql"])
async def test_a_nul_in_a_resource_id_costs_only_its_own_command(
    nats_url: str, sqlite_url: str, pg_database: str, store_kind: str
) -> None:
    agent = ledger_agent()
    url = sqlite_url if store_kind == "sqlite" else pg_database
    settings = settings_for(nats_url, url, batch_size=16)
    conn = await open_conn(settings)
    try:
        subject = f"cmd.default.test.{agent.name}.credit"
        good = [
            Envelope.new(f"{agent.name}.credit", {"account": f"acc{i}", "amount": 1})
            for i in range(6)
        ]
        bad = Envelope.new(f"{agent.name}.credit", {"account": "bad\u0000id", "amount": 1})
        # All in the stream before the worker starts: they arrive as one batch.
        await send_many(conn, [(subject, e) for e in (*good[:3], bad, *good[3:])])
        async with running([agent], settings):
            await wait_until(lambda: consumer_idle(conn, agent.name), within=15)
            info = await conn.js.consumer_info("MESHFORGE_COMMANDS", f"{agent.name}_consumer")
        events = [m.envelope() for m in await events_of(conn, agent.name)]
        applied = sorted(e.causation_id for e in events if e)
        letters = reasons(await dead_letters_of(conn, agent.name))
        assert info.num_redelivered == 0  # nothing went round the backoff
        if store_kind == "sqlite":  # SQLite keeps NUL in text: the command is fine there
            assert applied == sorted(e.id for e in (*good, bad)) and not letters
        else:
            assert applied == sorted(e.id for e in good)
            assert list(letters) == [bad.id]
            reason, error = letters[bad.id]
            assert reason == "unrecoverable" and "NUL" in error and "\n" not in error
    finally:
        await conn.close()


@pytest.mark.parametrize("store_kind", ["sqlite", "postgresql"])
async def test_a_nul_order_id_is_dead_lettered_alone_by_a_plain_function_agent(
    private_server: EmbeddedServer, sqlite_url: str, pg_database: str, store_kind: str
) -> None:
    # OrderAgent's handlers are plain functions: its transaction runs whole in the store thread.
    url = sqlite_url if store_kind == "sqlite" else pg_database
    settings = settings_for(private_server.url, url, batch_size=16)
    conn = await open_conn(settings)
    tenant = f"t{uuid.uuid4().hex[:8]}"  # the shared database: rows of this test's own
    subject = f"cmd.{tenant}.demo.order.create"
    try:
        good = [
            Envelope.new("order.create", {"order_id": f"o{i}", "sku": "S", "qty": 1})
            for i in range(4)
        ]
        bad = Envelope.new("order.create", {"order_id": "o\u0000bad", "sku": "S", "qty": 1})
        await send_many(conn, [(subject, e) for e in (good[0], good[1], bad, good[2], good[3])])
        async with running([OrderAgent()], settings):
            await wait_until(lambda: consumer_idle(conn, "order"), within=15)
            info = await conn.js.consumer_info("MESHFORGE_COMMANDS", "order_consumer")
        created = [m.envelope() for m in await events_of(conn, "order")]
        applied = sorted(e.causation_id for e in created if e)
        letters = reasons(await dead_letters_of(conn, "order"))
        assert info.num_redelivered == 0
        if store_kind == "sqlite":
            assert applied == sorted(e.id for e in (*good, bad)) and not letters
        else:
            assert applied == sorted(e.id for e in good)
            assert list(letters) == [bad.id] and letters[bad.id][0] == "unrecoverable"
            assert "NUL" in letters[bad.id][1]
    finally:
        await conn.close()


async def test_an_output_too_large_to_publish_is_refused_before_its_effect_is_stored(
    nats_url: str, sqlite_url: str
) -> None:
    agent = ledger_agent()
    settings = settings_for(nats_url, sqlite_url)
    conn = await open_conn(settings)
    try:
        subject = f"cmd.default.test.{agent.name}.credit"
        limit = conn.nc.max_payload
        huge = Envelope.new(
            f"{agent.name}.credit", {"account": "a", "amount": 5, "mode": "huge", "bytes": limit}
        )
        good = Envelope.new(f"{agent.name}.credit", {"account": "a", "amount": 1})
        await send_many(conn, [(subject, huge), (subject, good)])
        store = await open_store_async(sqlite_url)
        async with running([agent], settings, store=store):
            await wait_until(lambda: consumer_idle(conn, agent.name), within=15)
        stored = await asyncio.to_thread(lambda: list(store.effects_read()))
        store.close()
        letters = reasons(await dead_letters_of(conn, agent.name))
        reason, error = letters[huge.id]
        assert reason == "unrecoverable" and "max_payload" in error and "\n" not in error
        # No effect was kept for it (its outputs could never leave); the next command ran.
        assert [e.command_id for e in stored] == [good.id]
        [event] = [m.envelope() for m in await events_of(conn, agent.name)]
        assert event is not None and event.causation_id == good.id and event.payload["balance"] == 1
    finally:
        await conn.close()
