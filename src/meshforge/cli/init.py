"""``meshforge init NAME``: write a new project that runs and passes its tests at once.

The project holds one module per agent (state, handlers, ``apply``), tests using the
``meshforge.testing`` pytest plugin, ``meshforge.toml``, a ``compose.yaml`` (NATS with
JetStream, PostgreSQL when chosen), a Makefile (``run``, ``test``) and a README. Without
``--from`` it has one agent with one command; ``--from SPEC.yaml`` writes the agents,
commands and events a spec lists (see ``meshforge.cli.init_spec``).
"""

from __future__ import annotations

import json
import keyword
import re
import sys
from enum import StrEnum
from importlib import resources
from pathlib import Path
from string import Template
from typing import Annotated, Any

import typer

from meshforge.cli.init_spec import (
    AgentSpec,
    CommandSpec,
    FieldSpec,
    ProjectSpec,
    default_spec,
    load_spec,
)
from meshforge.errors import ConfigError, MeshForgeError

__all__ = ["render_project", "write_project"]

_PROJECT = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


class StoreKind(StrEnum):
    sqlite = "sqlite"
    postgres = "postgres"


class Profile(StrEnum):
    local = "local"
    compose = "compose"


def register(app: typer.Typer) -> None:
    app.command("init")(init)


def init(
    name: Annotated[
        str, typer.Argument(metavar="NAME", help="Directory (and project name) to create.")
    ],
    store: Annotated[
        StoreKind, typer.Option("--store", help="The store the agents keep effects and states in.")
    ] = StoreKind.sqlite,
    profile: Annotated[
        Profile,
        typer.Option(
            "--profile", help="local: an embedded nats-server; compose: NATS from compose.yaml."
        ),
    ] = Profile.local,
    spec: Annotated[
        Path | None,
        typer.Option(
            "--from", metavar="SPEC.yaml", help="Agents, commands and events to generate."
        ),
    ] = None,
) -> None:
    """Write a new project in ./NAME: agents, tests, meshforge.toml, compose.yaml, Makefile."""
    target = Path(name)
    project = load_spec(spec) if spec is not None else default_spec()
    files = render_project(target.name, project, store=store.value, profile=profile.value)
    write_project(target, files)
    typer.echo(f"created {target}/ ({len(files)} files)")
    typer.echo(f"next: cd {target} && make test && make run")


def package_name(project: str) -> str:
    """The Python package of a project: ``my-shop`` -> ``my_shop``; refused when unusable."""
    if not _PROJECT.fullmatch(project):
        raise ConfigError(
            f"project name {project!r}: expected a letter then letters, digits, '-' or '_' (64 at most)"
        )
    package = project.lower().replace("-", "_")
    if keyword.iskeyword(package) or package in sys.stdlib_module_names or package in (
        "meshforge", "tests", "test",
    ):  # fmt: skip
        raise ConfigError(
            f"project name {project!r}: its package {package!r} would shadow a module; choose another"
        )
    return package


def write_project(target: Path, files: dict[str, str]) -> None:
    """Write ``files`` under ``target``; refuse an existing non-empty directory or a file."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        # Not a usage error: the same command works elsewhere (exit 1, nothing written).
        raise MeshForgeError(f"{target} exists and is not empty; choose another NAME or empty it")
    for relative, text in files.items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def _template(name: str) -> Template:
    source = resources.files("meshforge.templates") / "project" / f"{name}.tmpl"
    return Template(source.read_text(encoding="utf-8"))


def render_project(project: str, spec: ProjectSpec, *, store: str, profile: str) -> dict[str, str]:
    """Every file of the project, by relative path (nothing is written here)."""
    package = package_name(project)
    for agent in spec.agents:
        if agent.key in ("status", "version", "data"):
            raise ConfigError(
                f"agent {agent.name!r}: key {agent.key!r} is a field of the state; choose another"
            )
    postgres = store == "postgres"
    store_url = (
        f"postgresql://meshforge:meshforge@127.0.0.1:5432/{package}"
        if postgres
        else "sqlite:///.meshforge/store.db"
    )
    first = spec.agents[0]
    specs = " ".join(f"{package}.{a.name}:{a.class_name}" for a in spec.agents)
    services = "NATS and PostgreSQL" if postgres else "NATS"
    values = {
        "project": project,
        "package": package,
        "agent_names": ", ".join(a.name for a in spec.agents),
        "agent_specs": specs,
        "store_url": store_url,
        "services": services,
        "requirement": "meshforge[postgres]>=0.1" if postgres else "meshforge>=0.1",
        "nats_line": (
            'nats_url = "nats://127.0.0.1:4222"   # the NATS of compose.yaml (`make up`)'
            if profile == "compose"
            else '# nats_url = "nats://127.0.0.1:4222"   # unset: `meshforge run` starts an embedded server'
        ),
        "sample_subject": f"cmd.default.{package}.{first.name}.{first.commands[0].name}",
        "sample_payload": json.dumps(sample_payload(first, first.commands[0])),
        "command_rows": "\n".join(
            f"| `{a.name}` | `{c.name}` (key `{a.key}`) | "
            + ", ".join(f"`{f.name}: {f.type}`" for f in a.payload_fields(c)).replace("|", "\\|")
            + f" | {', '.join(f'`{e}`' for e in c.events)} |"
            for a in spec.agents
            for c in a.commands
        ),
        "up_step": f"make up                        # {services} in containers\n"
        if postgres or profile == "compose"
        else "",
        "embedded_note": ""
        if profile == "compose"
        else " (an embedded nats-server starts with them)",
        "postgres_service": _POSTGRES_SERVICE.format(db=package) if postgres else "",
        "postgres_volume": "  pg-data:\n" if postgres else "",
    }
    files = {
        "README.md": _template("README.md").substitute(values),
        "pyproject.toml": _template("pyproject.toml").substitute(values),
        "meshforge.toml": _template("meshforge.toml").substitute(values),
        "compose.yaml": _template("compose.yaml").substitute(values),
        "Makefile": _template("Makefile").substitute(values),
        ".gitignore": _template("gitignore").substitute(values),
        f"{package}/__init__.py": _template("init.py").substitute(values),
        "tests/__init__.py": "",
    }
    for agent in spec.agents:
        files[f"{package}/{agent.name}.py"] = _agent_module(agent)
        files[f"tests/test_{agent.name}.py"] = _agent_tests(agent, package)
    return files


_POSTGRES_SERVICE = """  postgres:
    image: postgres:16
    environment: {{POSTGRES_USER: meshforge, POSTGRES_PASSWORD: meshforge, POSTGRES_DB: {db}}}
    ports: ["5432:5432"]
    volumes: ["pg-data:/var/lib/postgresql/data"]
"""


def _agent_module(agent: AgentSpec) -> str:
    structs = [
        _struct(agent.command_struct(c), f"The payload of ``{agent.name}.{c.name}``.",
                agent.payload_fields(c))
        for c in agent.commands
    ] + [
        _struct(agent.event_struct(e), f"The payload of ``{agent.name}.{e}``.",
                agent.payload_fields(c))
        for e, c in agent.events().items()
    ]  # fmt: skip
    handlers = "".join(
        _template("handler.py").substitute(
            command=c.name,
            key=agent.key,
            state=agent.state_name,
            agent=agent.name,
            payload=agent.command_struct(c),
            event_list=", ".join(f"``{agent.name}.{e}``" for e in c.events),
            events="\n".join(
                f'            Event("{e}", {agent.event_struct(e)}('
                + ", ".join(f"{f.name}=p.{f.name}" for f in agent.payload_fields(c))
                + ")),"
                for e in c.events
            ),
        )
        for c in agent.commands
    )
    key = agent.payload_fields(agent.commands[0])[0]
    return _template("agent.py").substitute(
        agent=agent.name, key=agent.key, state=agent.state_name, cls=agent.class_name,
        command_list=", ".join(f"``{c.name}``" for c in agent.commands), handlers=handlers,
        structs="".join(structs), key_type=key.type, key_default='""' if key.type == "str" else "0",
        event_map=", ".join(f'"{e}": {agent.event_struct(e)}' for e in agent.events()),
    )  # fmt: skip


def _struct(name: str, doc: str, fields: tuple[FieldSpec, ...]) -> str:
    lines = "\n".join(f"    {f.name}: {f.type}" + (" = None" if f.optional else "") for f in fields)
    return _template("struct.py").substitute(struct=name, doc=doc, fields=lines)


# A value of each field type for the generated tests, and one of another type.
_SAMPLES = {"str": "hello", "int": 2, "float": 1.5, "bool": True}
_WRONG = {"str": 1, "int": "x", "float": "x", "bool": "x"}


def _sample(kind: str) -> Any:
    base = kind.removesuffix(" | None")
    if base.startswith("list["):
        return [_SAMPLES[base[5:-1]]]
    return _SAMPLES[base]


def _wrong(kind: str) -> Any:
    base = kind.removesuffix(" | None")
    return "x" if base.startswith("list[") else _WRONG[base]


def _py(value: Any) -> str:
    """A Python literal of JSON-like ``value``, in double quotes as the project's code is."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py(k)}: {_py(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def sample_key(agent: AgentSpec) -> Any:
    """The resource the generated tests and ``make send`` use: ``order-1``, or 1."""
    return f"{agent.name}-1" if agent.payload_fields(agent.commands[0])[0].type == "str" else 1


def sample_payload(agent: AgentSpec, command: CommandSpec) -> dict[str, Any]:
    """A payload of ``command`` with every field set (to ``sample_key`` for the key)."""
    sample = sample_key(agent)
    return {f.name: sample if f.name == agent.key else _sample(f.type)
            for f in agent.payload_fields(command)}  # fmt: skip


def _agent_tests(agent: AgentSpec, package: str) -> str:
    sample = sample_key(agent)

    def payload(command: CommandSpec) -> dict[str, Any]:
        return sample_payload(agent, command)

    def data(command: CommandSpec) -> dict[str, Any]:
        return {k: v for k, v in payload(command).items() if k != agent.key}

    units = "".join(
        _template("test_command.py").substitute(
            command=c.name,
            cls=agent.class_name,
            sample=sample,
            payload=_py(payload(c)),
            data=_py(data(c)),
            event_words="_".join(c.events),
            types=", ".join(f'"{agent.name}.{e}"' for e in c.events),
            last=c.events[-1],
            count=len(c.events),
        )
        for c in agent.commands
    )
    first = agent.commands[0]
    fields = agent.payload_fields(first)
    wrong_field = fields[1] if len(fields) > 1 else fields[0]
    wrong = {**payload(first), wrong_field.name: _wrong(wrong_field.type)}
    return _template("test_agent.py").substitute(
        agent=agent.name, package=package, cls=agent.class_name, unit_tests=units,
        first=first.name, key=agent.key, sample=sample, first_event=first.events[0],
        first_last=first.events[-1], first_payload=_py(payload(first)),
        first_data=_py(data(first)), wrong_payload=_py(wrong),
        wrong_error=f"at `$.{wrong_field.name}`",
    )  # fmt: skip
