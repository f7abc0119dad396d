"""Every command, the worker, the node and the pipeline end in one line on bad credentials
or an untrusted server certificate, within the connect bound; nothing they print (stdout,
stderr, logs at DEBUG, --help) ever holds a password, token or NKey seed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nkeys
import pytest
from auth_support import configured_server, make_certs, make_operator, new_key, tls_block

from meshforge.transport.server import EmbeddedServer

TIMEOUT, ATTEMPTS = 1, 2
BOUND = TIMEOUT * ATTEMPTS + 1.5  # connect bound + bounded close and backoff
STARTUP = 20.0  # the interpreter and its imports, on a heavily loaded machine

PASSWORD = "Pw-planted-7781x"
TOKEN = "Tok-planted-5523y"
SEED = new_key(nkeys.PREFIX_BYTE_USER).seed  # valid, but no server knows it

# Each command with the arguments it needs to reach the point of connecting.
COMMANDS = {
    "provision": ["provision"],
    "publish": ["publish", "cmd.default.demo.order.create", '{"order_id": "o-1"}'],
    "dlq": ["dlq", "ls"],
    "ctl": ["ctl", "status", "lab1", "node1"],
    "run": ["run", "meshforge.demo:OrderAgent"],
    "node": ["node", "lab1", "node1"],
    "pipeline": ["pipeline", "ingest"],
}


def meshforge(cwd: Path, args: list[str], **env: str) -> tuple[int, str, float]:
    """Run the CLI; returns exit code, everything printed (stdout + stderr) and seconds taken."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MESHFORGE_")}
    base.update(
        MESHFORGE_CONNECT_TIMEOUT=str(TIMEOUT),
        MESHFORGE_CONNECT_ATTEMPTS=str(ATTEMPTS),
        MESHFORGE_STORE_URL=f"sqlite:///{cwd / 'store.db'}",
        MESHFORGE_LOG_LEVEL="DEBUG",  # the most a run can print
        PYTHONPATH=os.pathsep.join(sys.path),
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "meshforge", *args],
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,  # a hang fails the test instead of the whole run
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def assert_one_line_failure(
    code: int, out: str, took: float, *expected: str, exit_code: int = 1
) -> None:
    """Exit 1 for a failed connection, 2 for a bad setting; one ``error:`` line, in time."""
    assert code == exit_code, out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out
    assert "Traceback" not in out, out
    for text in expected:
        assert text.lower() in errors[0].lower(), out
    assert took < BOUND + STARTUP, f"took {took:.1f}s: {out}"


def assert_no_secret(out: str) -> None:
    for secret in (PASSWORD, TOKEN, SEED, SEED[11:]):
        assert secret not in out, f"{secret!r} printed:\n{out}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli-auth")


@pytest.fixture(scope="module")
def tls_server(workdir: Path) -> Iterator[EmbeddedServer]:
    """TLS with a CA the client is not told about, and a password."""
    certs = make_certs(workdir / "certs")
    config = tls_block(certs) + f"authorization {{ user: alice, password: {PASSWORD} }}\n"
    with configured_server(workdir / "tls", config) as server:
        yield server


@pytest.fixture(scope="module")
def token_server(workdir: Path) -> Iterator[EmbeddedServer]:
    with configured_server(workdir / "token", "authorization { token: the-right-one }\n") as server:
        yield server


@pytest.mark.parametrize("command", list(COMMANDS))
def test_untrusted_server_certificate_is_one_line(
    command: str, tls_server: EmbeddedServer, workdir: Path
) -> None:
    url = tls_server.url.replace("nats://", "tls://")
    code, out, took = meshforge(
        workdir, COMMANDS[command], MESHFORGE_NATS_URL=url,
        MESHFORGE_USER="alice", MESHFORGE_PASSWORD=PASSWORD,
    )  # fmt: skip
    assert_one_line_failure(
        code, out, took, f"cannot connect to NATS at {url}", "CERTIFICATE_VERIFY_FAILED"
    )
    assert_no_secret(out)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_wrong_token_is_one_line(command: str, token_server: EmbeddedServer, workdir: Path) -> None:
    code, out, took = meshforge(
        workdir, COMMANDS[command], MESHFORGE_NATS_URL=token_server.url, MESHFORGE_TOKEN=TOKEN
    )
    assert_one_line_failure(code, out, took, "Authorization Violation", "after 1 attempt(s)")
    assert_no_secret(out)


def test_refused_port_prints_a_line_per_retry(workdir: Path) -> None:
    url = f"nats://alice:{PASSWORD}@127.0.0.1:1"
    code, out, took = meshforge(workdir, ["provision", "--nats-url", url])
    assert_one_line_failure(code, out, took, "nats://***@127.0.0.1:1", "after 2 attempt(s)")
    retries = [line for line in out.splitlines() if "retrying in" in line]
    assert len(retries) == 1 and "(attempt 1 of 2)" in retries[0], out
    assert_no_secret(out)


def test_pipeline_ingest_refused_port_is_bounded(workdir: Path) -> None:
    code, out, took = meshforge(workdir, ["pipeline", "ingest", "--nats-url", "nats://127.0.0.1:1"])
    assert_one_line_failure(
        code, out, took, "cannot connect to NATS at nats://127.0.0.1:1", "refused"
    )
    assert "retrying in" in out


def test_secrets_never_printed_by_failing_runs(workdir: Path, token_server: EmbeddedServer) -> None:
    user = new_key(nkeys.PREFIX_BYTE_USER)
    config = f"authorization {{ users = [ {{ nkey: {user.public} }} ] }}\n"
    op = make_operator()
    # a real user JWT of this operator, carried with a seed that is not its own
    creds = op.creds(workdir / "planted.creds", seed=SEED)
    printed: list[str] = []
    with (
        configured_server(workdir / "nkey", config) as nkey_server,
        configured_server(workdir / "op", op.config()) as op_server,
    ):
        runs: list[tuple[list[str], dict[str, str], str]] = [
            # config errors: a URL with a password, a password in the store URL, a bad seed
            (["provision"], {"MESHFORGE_NATS_URL": f"http://alice:{PASSWORD}@127.0.0.1:1"}, "expected a URL"),
            (["publish", "cmd.default.demo.order.create", "{}", "--nats-url", f"http://alice:{PASSWORD}@h:1"], {}, "expected a URL"),
            (["run", "meshforge.demo:OrderAgent"], {"MESHFORGE_STORE_URL": f"mysql://alice:{PASSWORD}@h/db"}, "store_url"),
            (["dlq", "ls"], {"MESHFORGE_NKEY_SEED": SEED[:10] + ("A" if SEED[10] != "A" else "B") + SEED[11:]}, "MESHFORGE_NKEY_SEED"),
            (["dlq", "ls"], {"MESHFORGE_NKEY_SEED": SEED, "MESHFORGE_CREDS_FILE": str(creds)}, "only one of"),
            # refused logins
            (["publish", "cmd.default.demo.order.create", "{}"], {"MESHFORGE_NATS_URL": token_server.url, "MESHFORGE_TOKEN": TOKEN}, "Authorization"),
            (["provision", "--nats-url", token_server.url.replace("nats://", f"nats://{TOKEN}@")], {}, "Authorization"),
            (["run", "meshforge.demo:OrderAgent"], {"MESHFORGE_NATS_URL": nkey_server.url, "MESHFORGE_NKEY_SEED": SEED}, "Authorization"),
            (["node", "lab1", "node1"], {"MESHFORGE_NATS_URL": op_server.url, "MESHFORGE_CREDS_FILE": str(creds)}, "Authorization"),
            (["pipeline", "ingest"], {"MESHFORGE_NATS_URL": nkey_server.url, "MESHFORGE_NKEY_SEED": SEED}, "Authorization"),
            (["pipeline", "ingest", "--nats-url", f"nats://alice:{PASSWORD}@127.0.0.1:1"], {}, "refused"),
        ]  # fmt: skip
        # the runs wait on sockets and backoff, not on the CPU: a few at a time
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda run: meshforge(workdir, run[0], **run[1]), runs))
        for (_args, _env, expected), (code, out, took) in zip(runs, results, strict=True):
            usage = expected in (
                "expected a URL",
                "store_url",
                "MESHFORGE_NKEY_SEED",
                "only one of",
            )
            assert_one_line_failure(code, out, took, expected, exit_code=2 if usage else 1)
            printed.append(out)
    everything = {"MESHFORGE_PASSWORD": PASSWORD, "MESHFORGE_USER": "alice", "MESHFORGE_TOKEN": TOKEN,
                  "MESHFORGE_NKEY_SEED": SEED, "MESHFORGE_NATS_URL": f"nats://alice:{PASSWORD}@h:1"}  # fmt: skip
    with ThreadPoolExecutor(4) as pool:
        helps = list(
            pool.map(
                lambda c: meshforge(workdir, [*c[:1], "--help"], **everything), COMMANDS.values()
            )
        )
    for code, out, _took in helps:
        assert code == 0, out
        printed.append(out)
    assert len(printed) == len(runs) + len(COMMANDS)
    for out in printed:
        assert_no_secret(out)
