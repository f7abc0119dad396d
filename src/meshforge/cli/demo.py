"""``meshforge demo``: the whole story on an embedded server with nothing configured.

Provision; start the order and inventory agents as separate processes; run the smoke
scenario (create, get, the same create again with the same Idempotency-Key, inventory);
send many orders while the order agent is killed with SIGKILL and restarted; then count,
over the wire and in the stores, that nothing was lost or doubled, and replay the
event logs. Exits 1 if anything was lost or doubled.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from meshforge.cli.common import HOME, NatsUrl, nats_target

if TYPE_CHECKING:
    from meshforge.cli.demo_support import AgentProcess, EventWatch, StreamMessage
    from meshforge.envelope import Envelope
    from meshforge.transport.connection import Connection

ORDER = "meshforge.demo:OrderAgent"
INVENTORY = "meshforge.demo:InventoryAgent"
PREFIX = "cmd.default.demo"
SKUS = 20


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo(
    orders: Annotated[
        int, typer.Option("--orders", min=1, help="Orders sent under load.")
    ] = 10_000,
    kill_at: Annotated[
        float,
        typer.Option("--kill-at", min=0.01, max=0.99, help="Kill the order agent at this share."),
    ] = 0.3,
    timeout: Annotated[
        float, typer.Option("--timeout", min=5, help="Seconds to wait for processing.")
    ] = 240.0,
    report: Annotated[
        bool, typer.Option("--report/--no-report", help="End with the Spark ingest and audit.")
    ] = True,
    nats_url: NatsUrl = None,
    fleet: Annotated[
        bool,
        typer.Option(
            "--fleet",
            help="Tell the fleet story instead: a hub and 2 sites on leaf nodes (servers of its own), "
            "20 nodes, a rollout through a cut link, a cancel.",
        ),
    ] = False,
    fleet_nodes: Annotated[
        int, typer.Option("--fleet-nodes", min=2, max=100, help="Nodes per site (--fleet).")
    ] = 10,
) -> None:
    """Run the whole story: provision, agents, smoke test, load with a SIGKILL, audit, replay."""
    if fleet:
        from meshforge.cli.demo_fleet import run_fleet_demo

        if not run_fleet_demo(HOME, fleet_nodes):
            raise typer.Exit(1)
        return
    console = Console()
    work = HOME / "demo"
    shutil.rmtree(work, ignore_errors=True)  # the demo's own stores and logs, fresh each run
    work.mkdir(parents=True, exist_ok=True)
    store_url = f"sqlite:///{work / 'store.db'}"  # one file for both agents (SQLite WAL)
    with nats_target(nats_url) as url:
        start = asyncio.run(_next_seqs(url))
        ok = asyncio.run(_story(console, url, store_url, work, orders, kill_at, timeout))
        if report:
            ok = run_pipeline_report(url, store_url, work, console, start) is not False and ok
    if not ok:
        raise typer.Exit(1)


def run_pipeline_report(
    nats_url: str, store_url: str, work: Path, console: Console, start: dict[str, int] | None = None
) -> bool | None:
    """The Spark report over the demo's run: land MESHFORGE_EVENTS and MESHFORGE_FAILED
    (from the sequences in ``start`` on, so earlier runs on the same server are left out)
    in Parquet under ``work/pipeline``, audit them against the store at ``store_url``, and
    print where the report is. Returns the audit's verdict, or None when Spark or Java is
    not available (the report is then skipped with a one-line note).
    """
    try:
        pipelines = importlib.import_module("meshforge.spark.pipelines")
    except ImportError:
        console.print("[yellow]Spark report skipped: install meshforge[spark] for the pipeline[/]")
        return None
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        console.print("[yellow]Spark report skipped: Java 17+ not found[/]")
        return None
    from meshforge.cli.pipeline import print_summary, table_name

    console.rule("[bold]Spark pipeline: ingest and audit")
    out = work / "pipeline"
    spark = pipelines.spark_session(None, conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    try:
        tables: dict[str, str] = {}
        for stream in ("MESHFORGE_EVENTS", "MESHFORGE_FAILED"):
            first = (start or {}).get(stream, 1)
            options = {"startingOffsets": json.dumps({stream: first})}
            target = out / table_name(stream)
            result = pipelines.ingest(spark, nats_url, stream, target, options=options)
            console.print(f"ingest {stream}: {result.rows} rows -> {target}")
            if result.rows:
                tables[stream] = str(target)
        verdict = pipelines.audit(
            spark,
            tables["MESHFORGE_EVENTS"],
            out / "report",
            failed=tables.get("MESHFORGE_FAILED"),
            store_url=store_url,
        )
    finally:
        spark.stop()
    print_summary(verdict.findings)
    console.print(f"report: {verdict.html_path}")
    if verdict.ok:
        console.print("[green]audit: exactly-once holds over what landed[/]")
    else:
        console.print("[red]audit: exactly-once VIOLATED (see the report)[/]")
    return bool(verdict.ok)


async def _next_seqs(url: str) -> dict[str, int]:
    """The sequence the next message of the events and dead-letter streams will get."""
    from nats.js.errors import NotFoundError

    from meshforge.config import load_settings
    from meshforge.transport.connection import connect

    async with await connect(load_settings(), url=url, name="meshforge-demo") as conn:
        seqs: dict[str, int] = {}
        for stream in ("MESHFORGE_EVENTS", "MESHFORGE_FAILED"):
            try:
                seqs[stream] = int((await conn.js.stream_info(stream)).state.last_seq) + 1
            except NotFoundError:
                seqs[stream] = 1
        return seqs


@dataclass
class _Load:
    sent: dict[str, str] = field(default_factory=dict)  # command id -> order id
    created: set[str] = field(default_factory=set)  # order ids seen created (live)
    settled: set[str] = field(default_factory=set)  # order ids seen reserved/rejected (live)
    killed_at: int | None = None


async def _story(
    console: Console,
    url: str,
    store_url: str,
    work: Path,
    orders: int,
    kill_at: float,
    patience: float,
) -> bool:
    from meshforge.cli.demo_support import AgentProcess, EventWatch
    from meshforge.config import load_settings
    from meshforge.topology.provision import ensure
    from meshforge.topology.specs import agent_consumer, default_streams
    from meshforge.transport.connection import connect

    settings = load_settings({"nats_url": url})
    conn = await connect(settings, name="meshforge-demo")
    run = uuid.uuid4().hex[:6]
    agents = {
        "order": AgentProcess(ORDER, store_url, url, work / "order.log"),
        "inventory": AgentProcess(INVENTORY, store_url, url, work / "inventory.log"),
    }
    watch = EventWatch()
    try:
        console.rule("[bold]MeshForge demo")
        report = await ensure(
            conn.js, default_streams(settings),
            [agent_consumer("order", settings), agent_consumer("inventory", settings)],
        )  # fmt: skip
        console.print(f"provisioned: {len(report.applied)} change(s) on {url}")
        # Leftovers of an interrupted earlier run would only blur the counts.
        await conn.js.purge_stream("MESHFORGE_COMMANDS", subject=f"{PREFIX}.>")
        start_seq = (await conn.js.stream_info("MESHFORGE_EVENTS")).state.last_seq + 1
        await watch.start(conn.nc, "evt.default.demo.>")
        for proc in agents.values():
            proc.start()
        console.print(f"started agents order and inventory (logs and stores in {work})")
        await _smoke(console, conn, watch, run)
        load = await _load(console, conn, watch, agents["order"], run, orders, kill_at, patience)
        for proc in agents.values():
            proc.stop()
        return await _audit(console, conn, load, start_seq, store_url)
    finally:
        await watch.stop()
        for proc in agents.values():
            proc.stop(5)
        await conn.close()


async def _send(conn: Connection, command: str, payload: dict[str, Any], **fields: Any) -> Envelope:
    from meshforge.envelope import Envelope
    from meshforge.publish.publisher import Publisher

    env = Envelope.new(command, payload, source="demo", **fields)
    await Publisher(conn.js).publish(f"{PREFIX}.{command}", env)
    return env


def _caused_by(env: Envelope, type_: str) -> Any:
    return lambda e: e.type == type_ and e.causation_id == env.id


async def _smoke(console: Console, conn: Connection, watch: EventWatch, run: str) -> None:
    from meshforge.envelope import Envelope
    from meshforge.publish.publisher import Publisher

    sku = f"SMOKE-{run}"
    say = console.print
    say("\n[bold]--- Step 1: Create Order (Command) ---")
    key = str(uuid.uuid4())
    create = Envelope.new(
        "order.create", {"sku": sku, "qty": 2}, source="demo", idempotency_key=key
    )
    say(f"Publishing to {PREFIX}.order.create (ID={create.id}, Key={key})...")
    await Publisher(conn.js).publish(f"{PREFIX}.order.create", create)
    created = await watch.wait_for(_caused_by(create, "order.created"), 60)
    order_id = created.payload["order_id"]
    say(f"Received Event: evt.default.demo.order.created (ID={created.id})")
    say("✅ Order Created Event Verified.")

    say("\n[bold]--- Step 2: Verify State (Gateway) ---")
    say(f"Publishing to {PREFIX}.order.get for {order_id}...")
    get = await _send(conn, "order.get", {"order_id": order_id})
    found = await watch.wait_for(_caused_by(get, "order.found"), 30)
    order = found.payload["order"]
    say(
        f"Received Event: evt.default.demo.order.found (sku={order['sku']}, qty={order['qty']}, status={order['status']})"
    )
    say("✅ Order State Verified via Bus.")

    say("\n[bold]--- Step 3: Idempotency Test (Exactly-Once) ---")
    say("Re-publishing the SAME Create Command (new message id, same Idempotency-Key)...")
    mark = len(watch.seen)
    again = create.with_(id=str(uuid.uuid4()))
    await Publisher(conn.js).publish(f"{PREFIX}.order.create", again)
    echoed = await watch.wait_for(
        lambda e: e.type == "order.created" and e.id == created.id, 30, after=mark
    )
    say(f"Received Event: evt.default.demo.order.created (ID={echoed.id})")
    say("✅ Idempotency: Event re-received with the same id; no second order.")

    say("\n[bold]--- Step 4: Inventory Interaction ---")
    say(f"Publishing to {PREFIX}.inventory.create (sku={sku}, qty=10)...")
    stock = await _send(conn, "inventory.create", {"sku": sku, "qty": 10})
    await watch.wait_for(_caused_by(stock, "inventory.created"), 30)
    say("Received Event: evt.default.demo.inventory.created")
    say(f"Publishing to {PREFIX}.inventory.reserve (order {order_id}, qty=2)...")
    reserve = await _send(conn, "inventory.reserve", {"order_id": order_id, "sku": sku, "qty": 2})
    await watch.wait_for(_caused_by(reserve, "inventory.reserved"), 30)
    say("Received Event: evt.default.demo.inventory.reserved")
    get = await _send(conn, "inventory.get", {"sku": sku})
    level = await watch.wait_for(_caused_by(get, "inventory.found"), 30)
    say(
        f"Received Event: evt.default.demo.inventory.found (qty={level.payload['qty']}, reserved={level.payload['reserved']})"
    )
    say("✅ Inventory Agent verified.")
    say("\n🎉 SMOKE TEST PASSED!")


async def _load(
    console: Console, conn: Connection, watch: EventWatch, order_agent: AgentProcess,
    run: str, orders: int, kill_at: float, patience: float,
) -> _Load:  # fmt: skip
    from meshforge.envelope import Envelope, Outbound
    from meshforge.publish.publisher import Publisher
    from meshforge.runtime.agent import derive_uuid

    console.print(f"\n[bold]--- Load: {orders:,} orders; the order agent is killed part-way ---")
    skus = [f"SKU-{run}-{i:02d}" for i in range(SKUS)]
    stock = [await _send(conn, "inventory.create", {"sku": s, "qty": 3 * orders}) for s in skus]
    for env in stock:
        await watch.wait_for(_caused_by(env, "inventory.created"), 60)
    load = _Load()
    publisher = Publisher(conn.js)
    items: list[Outbound] = []
    for i in range(orders):
        env = Envelope.new("order.create", {"sku": skus[i % SKUS], "qty": 1 + i % 3}, source="demo")
        load.sent[env.id] = derive_uuid("order", env.key)
        items.append(Outbound.of(f"{PREFIX}.order.create", env))
    expected = set(load.sent.values())

    def on_event(e: Envelope) -> None:
        if e.type == "order.created" and e.causation_id in load.sent:
            load.created.add(e.payload.get("order_id", ""))
        elif (
            e.type in ("inventory.reserved", "inventory.rejected")
            and e.payload.get("order_id") in expected
        ):
            load.settled.add(e.payload["order_id"])

    watch.on_event = on_event
    columns = (
        TextColumn("{task.description:<26}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    started = time.monotonic()
    with Progress(*columns, console=console) as progress:
        sending = progress.add_task("sending orders", total=orders)
        creating = progress.add_task("orders created", total=orders)
        settling = progress.add_task("stock reserved", total=orders)

        async def send() -> None:
            for start in range(0, orders, 500):
                chunk = items[start : start + 500]
                await publisher.publish_many(chunk)
                progress.advance(sending, len(chunk))

        sender = asyncio.create_task(send())
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            progress.update(creating, completed=len(load.created))
            progress.update(settling, completed=len(load.settled))
            if load.killed_at is None and len(load.created) >= kill_at * orders:
                order_agent.kill()
                load.killed_at = len(load.created)
                progress.console.print(
                    f"💥 order agent killed with SIGKILL after {load.killed_at:,} orders; restarting it"
                )
                order_agent.start()
            if sender.done() and len(load.created) >= orders and len(load.settled) >= orders:
                break
            await asyncio.sleep(0.1)  # progress refresh, not synchronisation
        await sender
    console.print(f"load done in {time.monotonic() - started:.1f}s")
    return load


def effects_seen(
    events: list[StreamMessage], sent: dict[str, str]
) -> tuple[dict[str, list[str]], dict[str, list[str]], int]:
    """Per order command (``sent``: command id -> order id) its ``order.created`` messages,
    per order its reserve outcome messages, and how many were reserved. Every message is
    counted, even one whose id is already seen: an output published again after the
    duplicate window is stored twice, and that is a doubled effect."""
    orders = set(sent.values())
    created: dict[str, list[str]] = defaultdict(list)
    settled: dict[str, list[str]] = defaultdict(list)
    reserved = 0
    for message in events:
        env = message.envelope()
        if env is None:
            continue
        if env.type == "order.created" and env.causation_id in sent:
            created[env.causation_id].append(env.id)
        elif (
            env.type in ("inventory.reserved", "inventory.rejected")
            and env.payload.get("order_id") in orders
        ):
            settled[env.payload["order_id"]].append(env.id)
            reserved += env.type == "inventory.reserved"
    return created, settled, reserved


async def _audit(
    console: Console, conn: Connection, load: _Load, start_seq: int, store_url: str
) -> bool:
    from meshforge.cli.demo_support import meshforge_command, read_stream

    events = await read_stream(conn.js, "MESHFORGE_EVENTS", "evt.default.demo.>", start_seq)
    orders = set(load.sent.values())
    created, settled, reserved = effects_seen(events, load.sent)
    lost = (len(load.sent) - len(created)) + (len(orders) - len(settled))
    doubled = sum(len(ids) - 1 for ids in created.values()) + sum(
        len(ids) - 1 for ids in settled.values()
    )
    replays = {}
    for name, spec in (("order", ORDER), ("inventory", INVENTORY)):
        out = await asyncio.to_thread(
            subprocess.run,
            meshforge_command("replay", spec, "--store", store_url, "--json"),
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        replays[name] = (
            json.loads(out.stdout) if out.stdout.strip() else {"error": out.stderr.strip()}
        )
    consistent = all(r.get("mismatched") == [] for r in replays.values())

    table = Table(title="Exactly-once, checked from outside", show_lines=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("commands sent", f"{len(load.sent):,}")
    table.add_row("orders created", f"{len(created):,}")
    table.add_row("inventory reserved", f"{reserved:,} (+{len(settled) - reserved:,} rejected)")
    table.add_row("order agent SIGKILLed after", f"{load.killed_at or 0:,} orders")
    table.add_row("duplicate effects", _mark(doubled))
    table.add_row("lost commands", _mark(lost))
    for name, r in replays.items():
        if "error" in r:
            table.add_row(f"{name} replay", f"[red]{r['error'][:80]}")
            continue
        table.add_row(f"{name} events in log", f"{r['events']:,}")
        # One name per hash, as `meshforge replay` prints them.
        table.add_row(f"{name} state hash (of its events)", f"{r['state_hash'][:16]}…")
        table.add_row(f"{name} snapshot hash, stored", f"{r['stored_hash'][:16]}…")
        same = r["snapshot_hash"] == r["stored_hash"]
        table.add_row(
            f"{name} snapshot hash, replayed",
            f"{r['snapshot_hash'][:16]}… {'✅' if same else '❌'}",
        )
    console.print(table)
    ok = lost == 0 and doubled == 0 and consistent
    console.print(
        "[bold green]nothing lost, nothing doubled" if ok else "[bold red]exactly-once violated"
    )
    return ok


def _mark(count: int) -> str:
    return f"[green]{count}" if count == 0 else f"[red]{count}"
