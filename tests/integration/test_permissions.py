"""`meshforge permissions`: each role runs under exactly the block the command prints, and
fails with one line when one of its permissions is taken away."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from ops_support import Child, http_get, status
from typer.testing import CliRunner

from meshforge.cli import app
from meshforge.cli.demo_support import meshforge_command
from meshforge.config import load_settings
from meshforge.control.jobs import JobStore
from meshforge.control.presence import nodes_bucket
from meshforge.envelope import Envelope, decode
from meshforge.spark.fetch import read_range
from meshforge.spark.nats_sync import ConnOptions, SyncNats
from meshforge.topology.permissions import password_variable
from meshforge.topology.specs import agent_consumer
from meshforge.topology.subjects import STREAM_EVENTS, STREAM_REPLIES
from meshforge.transport.connection import Connection, connect
from meshforge.transport.server import EmbeddedServer
from polling import wait_until

ROLES = ("admin", "agent", "node", "publisher", "spark")
OPTIONS = [
    "--agent", "order", "--tenant", "default", "--site", "lab1", "--node", "n1",
    "--subject", "cmd.default.>", "--subject", "control.cmd.lab1.n1",
    "--write", "evt.default.pipeline.>",
]  # fmt: skip
ENV = {"MESHFORGE_TENANT": "default", "MESHFORGE_LOG_LEVEL": "INFO"}


def printed(*roles: str) -> str:
    result = CliRunner().invoke(app, ["permissions", *roles, *OPTIONS])
    assert result.exit_code == 0, result.output
    return result.output


def password(role: str) -> str:
    return f"pw-{role}-7Q"


def creds(role: str) -> dict[str, str]:
    return {**ENV, "MESHFORGE_USER": f"meshforge-{role}", "MESHFORGE_PASSWORD": password(role)}


@pytest.fixture
def serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Start a server whose whole configuration is the given authorization block."""
    for role in ROLES:
        monkeypatch.setenv(password_variable(f"meshforge-{role}"), password(role))
    servers: list[EmbeddedServer] = []

    def start(block: str) -> EmbeddedServer:
        conf = tmp_path / f"auth{len(servers)}.conf"
        conf.write_text(block)
        server = EmbeddedServer(
            store_dir=tmp_path / f"nats{len(servers)}", extra_args=["-c", str(conf)]
        )
        servers.append(server.start())
        return server

    yield start
    for server in servers:
        server.close()


def violations(server: EmbeddedServer) -> list[str]:
    return [line for line in server.log_file.read_text().splitlines() if "Violation" in line]


async def as_role(server: EmbeddedServer, role: str) -> Connection:
    s = load_settings(
        {"user": f"meshforge-{role}", "password": password(role), "connect_attempts": 1}, env={}
    )
    return await connect(s, url=server.url)


def run_cli(*args: str, role: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        meshforge_command(*args, "--nats-url", url), capture_output=True, text=True, timeout=60,
        env={**_clean_env(), **creds(role)},
    )  # fmt: skip


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_")}


async def last(admin: Connection, stream: str, subject: str) -> Envelope | None:
    try:
        msg = await admin.js.get_last_msg(stream, subject)
    except Exception:
        return None
    return decode(msg.data or b"", dict(msg.headers or {}))


def provision_as_admin(server: EmbeddedServer) -> None:
    """The order agent's and node lab1.n1's topology, made by the admin role."""
    args = ("provision", "--agent", "order", "--site", "lab1", "--node", "n1")
    done = run_cli(*args, role="admin", url=server.url)
    assert done.returncode == 0, done.stderr


@pytest.fixture
async def provisioned(serve: object) -> AsyncIterator[tuple[EmbeddedServer, Connection]]:
    server: EmbeddedServer = serve(printed(*ROLES))  # type: ignore[operator]
    provision_as_admin(server)
    admin = await as_role(server, "admin")
    await nodes_bucket(admin.js, create=True)  # presence: created at deploy time, like the streams
    yield server, admin
    await admin.close()


async def test_every_role_runs_under_exactly_what_it_prints(
    provisioned: tuple[EmbeddedServer, Connection], tmp_path: Path
) -> None:
    server, admin = provisioned
    # publisher: a command to the order agent
    sent = run_cli("publish", "cmd.default.demo.order.create", '{"order_id": "o-1", "sku": "S", "qty": 1}',
                   role="publisher", url=server.url)  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    # agent: a worker that only checks the topology, processes it, and answers /healthz
    worker = Child(
        ["run", "meshforge.demo:OrderAgent", "--no-provision", "--metrics-port", "0",
         "--store", f"sqlite:///{tmp_path / 'worker.db'}", "--nats-url", server.url],
        tmp_path / "worker.log", env=creds("agent"),
    )  # fmt: skip
    node = Child(
        ["node", "lab1", "n1", "--no-provision", "--presence-interval", "1",
         "--store", f"sqlite:///{tmp_path / 'node.db'}", "--nats-url", server.url],
        tmp_path / "node.log", env=creds("node"),
    )  # fmt: skip
    try:
        port = await worker.metrics_port()
        created = "evt.default.demo.order.created"
        await wait_until(lambda: last(admin, STREAM_EVENTS, created), 30, "the order.created event")
        await wait_until(lambda: _healthy(port), 20, "worker /healthz")
        code, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/healthz")
        assert code == 200 and "error" not in json.loads(body)["jetstream"], body
        # node: answers a control command the publisher role sends
        command = json.dumps({"type": "echo", "payload": {"say": "hi"}})
        sent = run_cli("publish", "control.cmd.lab1.n1", command, role="publisher", url=server.url)
        assert sent.returncode == 0, sent.stderr
        await wait_until(
            lambda: last(admin, STREAM_REPLIES, "control.reply.lab1.n1"), 30, "the node's reply"
        )
        reply = await last(admin, STREAM_REPLIES, "control.reply.lab1.n1")
        assert reply is not None and reply.payload["status"] == "ok", reply
        assert reply.payload["result"] == {"say": "hi"}
        # node: reads the jobs bucket before it runs a job's command (was it canceled?)
        await JobStore.open(admin.js)  # the bucket, created at deploy time
        command = json.dumps({"id": "c-j9", "type": "echo", "payload": {}, "job": "j9"})
        sent = run_cli("publish", "control.cmd.lab1.n1", command, role="publisher", url=server.url)
        assert sent.returncode == 0, sent.stderr

        async def answered() -> bool:
            reply = await last(admin, STREAM_REPLIES, "control.reply.lab1.n1")
            return reply is not None and reply.causation_id == "c-j9"

        await wait_until(answered, 30, "the node's reply to the job's command")
        reply = await last(admin, STREAM_REPLIES, "control.reply.lab1.n1")
        assert reply is not None and reply.payload["status"] == "ok", reply
        kv = await admin.js.key_value("MESHFORGE_NODES")
        assert json.loads((await kv.get("lab1.n1")).value or b"{}")["epoch"] == 1  # presence
    finally:
        assert worker.stop() == 0, worker.output()
        assert node.stop() == 0, node.output()
    # spark: read the events with the pipeline's reader, write one row back
    rows = await asyncio.to_thread(_spark_read_and_write, server.url)
    assert created in rows
    assert violations(server) == [], "\n".join(violations(server))
    assert "Traceback" not in worker.output() + node.output()


async def _healthy(port: int) -> bool:
    return await asyncio.to_thread(status, port, "/healthz") == 200


def _spark_read_and_write(url: str) -> list[str]:
    options = {"servers": url, "user": "meshforge-spark", "password": password("spark")}
    with SyncNats(ConnOptions.from_options(options)) as client:
        info = client.stream_info(STREAM_EVENTS)
        subjects = [
            s
            for chunk in read_range(client, STREAM_EVENTS, 1, info.last_seq)
            for s in chunk.subjects
        ]
        ack = client.run(client.js.publish("evt.default.pipeline.audited", b"{}"))
        assert ack.stream == STREAM_EVENTS
    return subjects


def without(block: str, role: str, subject: str) -> str:
    """The block with one allowed subject taken from one role's user."""
    head, user, rest = block.partition(f'user: "meshforge-{role}"')
    line = f'            "{subject}"\n'
    assert line in rest.split("user:", 1)[0], f"{role} has no {subject}"
    return head + user + rest.replace(line, "", 1)


AGENT_DURABLE = agent_consumer("order", load_settings({"tenant": "default"}, env={})).durable
CASES = {
    "admin": ("$JS.API.>", ["provision", "--agent", "order"]),
    "agent": (f"$JS.API.CONSUMER.INFO.MESHFORGE_COMMANDS.{AGENT_DURABLE}",
              ["run", "meshforge.demo:OrderAgent", "--no-provision"]),
    "node": ("$JS.API.CONSUMER.INFO.MESHFORGE_CONTROL.node_lab1_n1", ["node", "lab1", "n1", "--no-provision"]),
    "publisher": ("cmd.default.>", ["publish", "cmd.default.demo.order.create", '{"sku": "S", "qty": 1}']),
}  # fmt: skip


@pytest.mark.parametrize("role", sorted(CASES))
async def test_a_missing_permission_is_one_line(role: str, serve: object, tmp_path: Path) -> None:
    subject, args = CASES[role]
    block = without(printed(*ROLES), role, subject)
    if role == "admin":  # an empty allow list would allow everything: keep one harmless entry
        block = block.replace(
            "allow: [\n          ]", 'allow: [\n            "$JS.API.INFO"\n          ]', 1
        )
    server: EmbeddedServer = serve(block)  # type: ignore[operator]
    if role != "admin":
        provision_as_admin(server)
    store = ["--store", f"sqlite:///{tmp_path / 's.db'}"] if role in ("agent", "node") else []
    done = run_cli(*args, *store, role=role, url=server.url)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    # Log lines may come before it; the command's answer is its last line, and only one.
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "permissions violation for publish to" in error, (
        done.stderr
    )
    assert [line for line in done.stderr.splitlines() if line.startswith("error")] == [error]
    if role != "admin":
        assert f'"{subject.lower().rstrip(">").rstrip(".")}' in error


def test_spark_without_stream_info_is_one_line(serve: object) -> None:
    block = without(printed(*ROLES), "spark", "$JS.API.STREAM.INFO.MESHFORGE_EVENTS")
    server: EmbeddedServer = serve(block)  # type: ignore[operator]
    with pytest.raises(Exception) as info:
        _spark_read_and_write(server.url)
    message = str(info.value)
    assert "\n" not in message and "$JS.API.STREAM.INFO.MESHFORGE_EVENTS" in message, message
    assert "permissions violation" in message.lower() and "meshforge permissions spark" in message


async def test_healthz_without_js_api_info_is_a_permission_violation(
    serve: object, tmp_path: Path
) -> None:
    """Why the agent role has $JS.API.INFO: without it, every /healthz is a violation."""
    server: EmbeddedServer = serve(without(printed(*ROLES), "agent", "$JS.API.INFO"))  # type: ignore[operator]
    done = run_cli("provision", "--agent", "order", role="admin", url=server.url)
    assert done.returncode == 0, done.stderr
    worker = Child(
        ["run", "meshforge.demo:OrderAgent", "--no-provision", "--metrics-port", "0",
         "--store", f"sqlite:///{tmp_path / 'worker.db'}", "--nats-url", server.url],
        tmp_path / "worker.log", env=creds("agent"),
    )  # fmt: skip
    try:
        port = await worker.metrics_port()
        await wait_until(lambda: _ready(port), 30, "the worker's /readyz")
        _, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/healthz")
        assert "error" in json.loads(body)["jetstream"]
        await wait_until(
            lambda: any("$JS.API.INFO" in v for v in violations(server)), 10, "the violation"
        )
    finally:
        assert worker.stop() == 0, worker.output()


async def _ready(port: int) -> bool:
    return await asyncio.to_thread(status, port, "/readyz") == 200


async def test_a_partitioned_agent_runs_under_exactly_what_it_prints(
    serve: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With partitions the agent role pulls the partition durables, unpins them when it
    claims one, and keeps its leases in the ownership bucket; nothing more."""
    monkeypatch.setenv("MESHFORGE_PARTITIONS", "2")
    server: EmbeddedServer = serve(printed("admin", "agent", "publisher"))  # type: ignore[operator]
    done = run_cli(
        "provision", "--agent", "order", "--partitions", "2", role="admin", url=server.url
    )
    assert done.returncode == 0, done.stderr
    admin = await as_role(server, "admin")
    worker = Child(
        ["run", "meshforge.demo:OrderAgent", "--no-provision", "--partitions", "2",
         "--store", f"sqlite:///{tmp_path / 'worker.db'}", "--nats-url", server.url],
        tmp_path / "worker.log", env=creds("agent"),
    )  # fmt: skip
    try:
        for order in ("o-1", "o-2", "o-3"):  # partitioned by the publisher, and one not
            sent = _publish_order(server.url, order, partitions="2" if order != "o-3" else "0")
            assert sent.returncode == 0, sent.stderr

        async def created() -> bool:
            info = await admin.js.stream_info(
                STREAM_EVENTS, subjects_filter="evt.default.demo.order.created"
            )
            return bool(info.state.subjects) and sum((info.state.subjects or {}).values()) == 3

        await wait_until(created, 30, "three order.created events")
    finally:
        assert worker.stop() == 0, worker.output()
        await admin.close()
    assert violations(server) == [], "\n".join(violations(server))
    assert "Traceback" not in worker.output()
    assert "claimed" in worker.output()


def _publish_order(url: str, order: str, partitions: str) -> subprocess.CompletedProcess[str]:
    body = json.dumps({"order_id": order, "sku": "S", "qty": 1, "resource_id": order})
    return subprocess.run(
        meshforge_command("publish", "cmd.default.demo.order.create", body, "--nats-url", url),
        capture_output=True, text=True, timeout=60,
        env={**_clean_env(), **creds("publisher"), "MESHFORGE_PARTITIONS": partitions},
    )  # fmt: skip
