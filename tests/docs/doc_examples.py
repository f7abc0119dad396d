"""Run the examples of README.md and docs/*.md, with Sybil parsing the Markdown.

What each fenced block is, and what happens to it:

- ``python``: run as a whole program (a fresh namespace, in the document's directory,
  ``MESHFORGE_NATS_URL`` naming the document's server).
- ``console``, or a block without a language whose first line starts with ``$ ``: a shell
  session. Each ``$ command`` runs with bash in the document's directory (one per
  document, with its own embedded nats-server announced there, as `meshforge server`
  does); the lines shown under it are compared with what it printed (stdout and stderr),
  ids, times, hashes and ports masked, ``...`` matching anything. A command ending in
  ``&`` runs in the background until the document ends; ``kill -INT %1`` signals the
  first of them and waits for it to end, as in an interactive shell (Ctrl-C).
- ``bash`` / ``sh``: instructions, often for other machines: every ``meshforge`` command
  in them is parsed by the real command line (options, arguments, values), not run.
- a block whose first line names a file (``# test_orders.py``, ``# pytest.ini``,
  ``# check.py``) is that file, written in the document's directory: ``ini`` files stay
  there for later blocks; ``test_*.py`` runs with pytest (passing, with no warnings); other
  ``.py`` files run with python. A ``toml`` block named ``# meshforge.toml`` must load as
  settings.
- anything else (``text``, ``json``, ``sql``, ``hcl``, diagrams): not an example.

A marker in an HTML comment right before a block changes that, visibly in the source:

- ``<!-- docs-test: skip REASON -->``: the block is not an example (the reason is required);
- ``<!-- docs-test: parse-only REASON -->``: a session's ``meshforge`` commands are parsed,
  not run (for a command that needs what the session does not have);
- ``<!-- docs-test: fragment REASON -->``: a Python block that is a part of a program: it
  must compile (``await`` allowed at the top) and every MeshForge name it imports must exist;
- ``<!-- docs-test: new-session REASON -->``: the session starts again (a new empty
  directory and server) for this block and the rest of the document.

A read-only command (``dlq ls``, ``events tail``, ``ctl status``, ``cat``...) whose shown
output is not there yet runs again until it is (a worker in the background may still be
at it), for up to READ_PATIENCE seconds.
"""

from __future__ import annotations

import ast
import contextlib
import doctest
import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sybil import Document, Example, Region
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer, RawFencedCodeBlockLexer
from typer._click.exceptions import ClickException  # typer's own copy of click
from typer.exceptions import Exit
from typer.main import get_command

from meshforge.cli import app
from meshforge.cli.common import embedded_server

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MODES = ("skip", "parse-only", "fragment", "new-session")
#: Commands that only read: shown output they do not print yet is waited for (a person
#: would run them again), up to READ_PATIENCE seconds; other commands run once.
READS = re.compile(r"^(meshforge (dlq (ls|show)|events|ctl (status|reply|nodes))|cat|grep|tail) ")
READ_PATIENCE = 20.0
COMMAND_TIMEOUT = 90.0

_FENCE_INFO = re.compile(r"(?P<language>[\w+-]*)[^\n]*$\n", re.MULTILINE)
_MARKER = DirectiveInHTMLCommentLexer(directive="docs-test", arguments=r".+?")


@dataclass
class Session:
    """One document's directory, server and background processes."""

    directory: Path
    server_url: str | None = None
    background: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _servers: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    mode: tuple[str, str] | None = None  # the marker that applies to the next block

    def url(self) -> str:
        """The document's server, started the first time an example needs it."""
        if self.server_url is None:
            home = self.directory / ".meshforge"
            server = self._servers.enter_context(embedded_server(home))
            self.server_url = server.url
        return self.server_url

    def env(self) -> dict[str, str]:
        # Output goes to a pipe, as `| less` would: no COLUMNS of a terminal (xdist sets one).
        dropped = ("MESHFORGE_", "PYTEST_", "COLUMNS", "LINES")
        env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
        shims = self.directory.parent / "bin"
        if not shims.exists():
            shims.mkdir()
            shim = shims / "meshforge"
            shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m meshforge "$@"\n')
            shim.chmod(0o755)
        env["PATH"] = f"{shims}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
        env["NO_COLOR"] = "1"
        return env

    def restart(self) -> None:
        """Stop everything and start over in a new empty directory."""
        self.close()
        self.directory = self.directory.with_name(self.directory.name + "+")
        self.directory.mkdir()
        self.server_url, self.background, self._servers = None, [], contextlib.ExitStack()

    def close(self) -> None:
        for proc in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self._servers.close()


# ------------------------------------------------------------------ parsing
def parse(path: Path) -> Document:
    """The document with its blocks and markers as Sybil regions, in order."""
    document = Document(path.read_text(), str(path))
    for lexed in _MARKER(document):
        document.add(Region(lexed.start, lexed.end, _marker(lexed.lexemes["arguments"]), _set_mode))
    for lexed in RawFencedCodeBlockLexer(_FENCE_INFO, {"language": "language", "source": "source"})(
        document
    ):
        kind = block_kind(lexed.lexemes["language"], str(lexed.lexemes["source"]))
        if kind is not None:
            document.add(
                Region(lexed.start, lexed.end, (kind, str(lexed.lexemes["source"])), _run_block)
            )
    return document


def _marker(arguments: str) -> tuple[str, str]:
    mode, _, reason = arguments.strip().partition(" ")
    if mode not in MODES:
        raise ValueError(f"docs-test marker {mode!r}: expected one of {', '.join(MODES)}")
    if not reason.strip():
        raise ValueError(f"docs-test marker {mode!r} needs a reason")
    return mode, reason.strip()


_FILE_NAME = re.compile(r"# ([\w.-]+\.(?:py|ini|toml))\n")


def block_kind(language: str, source: str) -> str | None:
    """``python``, ``session``, ``commands``, ``file`` or None (not an example)."""
    named = _FILE_NAME.match(source)
    if named and (language, named.group(1).rsplit(".", 1)[1]) in (("python", "py"), ("ini", "ini")):
        return "file"
    if language == "toml" and named and named.group(1) == "meshforge.toml":
        return "settings"
    if language == "python":
        return "python"
    if language == "console" or (not language and source.startswith("$ ")):
        return "session"
    if language in ("bash", "sh", "shell"):
        return "commands"
    return None


def _set_mode(example: Example) -> None:
    session: Session = example.namespace["session"]
    session.mode = example.parsed


def _run_block(example: Example) -> str | None:
    session: Session = example.namespace["session"]
    kind, source = example.parsed
    mode, session.mode = session.mode, None
    if mode is not None and mode[0] == "skip":
        return None
    if mode is not None and mode[0] == "new-session":
        session.restart()
    if kind == "file":
        return run_file(source, session)
    if kind == "settings":
        return check_settings(source, session)
    if kind == "python":
        return (
            check_fragment(source)
            if mode and mode[0] == "fragment"
            else run_python(source, session)
        )
    if kind == "commands" or (mode and mode[0] == "parse-only"):
        return check_commands(source)
    return run_session(source, session)


# ------------------------------------------------------------------ python
def run_python(source: str, session: Session) -> str | None:
    """Run a block as ``python block.py`` would, in the session's directory."""
    env = session.env() | {"MESHFORGE_NATS_URL": session.url()}
    script = session.directory / "example.py"
    script.write_text(source)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=session.directory, env=env,
        capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
    )  # fmt: skip
    if done.returncode != 0:
        return f"the Python block failed (exit {done.returncode}):\n{done.stdout}{done.stderr}"
    return None


def run_file(source: str, session: Session) -> str | None:
    """Write the named file; run a test file with pytest, a program with python."""
    name = _FILE_NAME.match(source).group(1)  # type: ignore[union-attr]  # block_kind matched it
    (session.directory / name).write_text(source)
    if name.endswith(".ini"):
        return None
    env = session.env() | {"MESHFORGE_NATS_URL": session.url()}
    tests = name.startswith("test_")
    argv = (
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name]
        if tests
        else [sys.executable, name]
    )
    done = subprocess.run(
        argv,
        cwd=session.directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )
    summary = done.stdout.strip().splitlines()[-1:] if tests else []
    if done.returncode != 0 or any("warning" in line for line in summary):
        return f"`{shlex.join(argv[1:])}` (exit {done.returncode}):\n{done.stdout}{done.stderr}"
    return None


def check_settings(source: str, session: Session) -> str | None:
    """A ``meshforge.toml`` shown in a document loads as settings."""
    from meshforge.config import load_settings
    from meshforge.errors import ConfigError

    path = session.directory / "shown-meshforge.toml"
    path.write_text(source)
    try:
        load_settings(env={}, config_file=path)
    except ConfigError as exc:
        return f"the meshforge.toml shown does not load: {exc}"
    return None


def check_fragment(source: str) -> str | None:
    """A fragment compiles, and what it imports exists."""
    try:
        tree = compile(
            source, "<fragment>", "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        )
    except SyntaxError as exc:
        return f"the Python fragment does not compile: {exc}"
    for node in ast.walk(tree):  # MeshForge's names only: a web framework need not be installed
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("meshforge")
            and node.level == 0
        ):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    with contextlib.suppress(ImportError):
                        importlib.import_module(f"{node.module}.{alias.name}")
                        continue
                    return f"the fragment imports {alias.name!r} from {node.module}, which has none"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("meshforge"):
                    importlib.import_module(alias.name)
    return None


# ------------------------------------------------------------------ command lines
def meshforge_commands(source: str) -> Iterator[list[str]]:
    """The arguments of every ``meshforge`` command in a block of shell lines."""
    text = re.sub(r"\\\n", " ", source)
    for raw in text.splitlines():
        line = raw[2:] if raw.startswith("$ ") else raw
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError:
            continue  # output lines of a session are not shell
        command: list[str] | None = None
        starts = True  # at the start of a command (after env assignments)
        for token in [*tokens, ";"]:
            if token in (";", "&&", "||", "|", "&", ">", ">>", "<", "2>", "(", ")"):
                if command is not None:
                    yield command
                command, starts = None, True
            elif command is not None:
                command.append(token)
            elif starts and token.rsplit("/", 1)[-1] == "meshforge":
                command = []
            elif not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", token):
                starts = False


def parse_command(args: list[str]) -> str | None:
    """Parse ``meshforge ARGS`` as the real command line does; the error, or None."""
    command: Any = get_command(app)
    try:
        ctx = command.make_context("meshforge", list(args))
        while hasattr(command, "resolve_command"):  # a group: on to its sub-command
            rest = [*ctx._protected_args, *ctx.args]
            if not rest:
                break
            name, sub, rest = command.resolve_command(ctx, rest)
            assert name is not None and sub is not None
            command = sub
            ctx = command.make_context(name, rest, parent=ctx)
    except Exit:
        return None  # --help, --version
    except ClickException as exc:
        return f"`meshforge {shlex.join(args)}`: {exc.format_message()}"
    return None


def check_commands(source: str) -> str | None:
    errors = [e for args in meshforge_commands(source) if (e := parse_command(args))]
    return "\n".join(errors) or None


# ------------------------------------------------------------------ sessions
_MASKS = [
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), "<id>"),
    (re.compile(r"\b[0-9a-f]{32}\b"), "<hex>"),
    (re.compile(r"\b[0-9a-f]{16}\b"), "<hex>"),
    # Every moment the CLI prints: RFC 3339, a log line's stamp, `dlq ls`'s `MM-DD HH:MM:SS`.
    (
        re.compile(r"\b(?:\d{4}-)?\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:\d\d)?"),
        "<time>",
    ),
    (re.compile(r"\b\d\d:\d\d:\d\d(?:\.\d+)?"), "<time>"),
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:<port>"),
    (re.compile(r"\bpid \d+"), "pid <pid>"),
    # Ages and measured durations: `7.1s ago`, `ctl nodes`'s AGO column `1.6s`.
    (re.compile(r"\b\d+(?:\.\d+)?s ago"), "<n>s ago"),
    (re.compile(r"\b\d+\.\d+s\b"), "<n>s"),
    (re.compile(r"[─━═]+"), "─"),
]


def mask(text: str) -> str:
    for pattern, replacement in _MASKS:
        text = pattern.sub(replacement, text)
    return text


def steps(source: str) -> Iterator[tuple[str, str]]:
    """``(command, shown output)`` for each ``$ `` line of a session."""
    command: str | None = None
    shown: list[str] = []
    for line in source.splitlines():
        if line.startswith("$ "):
            if command is not None:
                yield command, "\n".join(shown).strip("\n")
            command, shown = line[2:], []
            continue
        if command is not None and command.endswith("\\"):
            command = command[:-1] + " " + line.strip()
            continue
        shown.append(line)
    if command is not None:
        yield command, "\n".join(shown).strip("\n")


_CHECKER = doctest.OutputChecker()
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def matches(shown: str, got: str) -> bool:
    """Whether the output shown in the document is what the command printed, masked."""
    want = re.sub(r"\b[0-9a-f]{8}-\.\.\.", "...", shown)
    return _CHECKER.check_output(mask(want) + "\n", mask(got) + "\n", _FLAGS)


_JOB = re.compile(r"kill(?: -(?:SIG)?([A-Z]+))? %(\d+)$")


def stop_job(session: Session, signame: str, number: int) -> str | None:
    """``kill -SIG %N``: signal the session's N-th background command and wait for its end."""
    if not 0 < number <= len(session.background):
        return f"kill %{number}: there are {len(session.background)} background command(s)"
    proc = session.background[number - 1]
    os.killpg(proc.pid, getattr(signal, f"SIG{signame}"))  # its group: bash and what it started
    try:
        proc.wait(COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"kill -{signame} %{number}: still running after {COMMAND_TIMEOUT:g}s"
    return None


def run_session(source: str, session: Session) -> str | None:
    session.url()  # announced in the directory: commands there find it, as after `meshforge server`
    for command, shown in steps(source):
        if command.rstrip().endswith("&"):
            log = (session.directory / f"background-{len(session.background)}.log").open("wb")
            proc = subprocess.Popen(
                ["bash", "-c", command.rstrip()[:-1]], cwd=session.directory, env=session.env(),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            session.background.append(proc)
            if shown:
                return f"`{command}` runs in the background: show its output with a later command"
            continue
        job = _JOB.match(command.strip())
        if job:
            error = stop_job(session, job.group(1) or "TERM", int(job.group(2)))
            if error:
                return error
            continue
        deadline = time.monotonic() + (READ_PATIENCE if READS.match(command) and shown else 0)
        while True:
            done = subprocess.run(
                ["bash", "-c", command], cwd=session.directory, env=session.env(),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=COMMAND_TIMEOUT,
            )  # fmt: skip
            got = done.stdout.decode(errors="backslashreplace").rstrip("\n")
            if not shown or matches(shown, got) or time.monotonic() > deadline:
                break
        # What is shown must be what it printed (then a failure shown is expected); with
        # nothing shown, it must succeed.
        if shown and not matches(shown, got):
            return (
                f"`{command}` (exit {done.returncode}) printed:\n{got}\n"
                f"--- the document shows:\n{shown}"
            )
        if not shown and done.returncode != 0:
            return f"`{command}` failed (exit {done.returncode}):\n{got}"
    return None


def evaluate(document: Document, session: Session, root: Path = ROOT) -> list[str]:
    """Every example of the document, in order; the failures, each naming its line."""
    document.namespace["session"] = session
    failures: list[str] = []
    for example in document:
        result = example.region.evaluator(example) if example.region.evaluator else None
        if result:
            failures.append(f"{Path(example.path).relative_to(root)}:{example.line}: {result}")
    return failures
