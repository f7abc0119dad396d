"""T1 and T2: what typed payloads cost, on the same agent and the same payload, beside a
dict payload checked by hand.

``CheckedEchoAgent`` takes ``echo.work {"id", "blob", "t"}`` as a dict and checks each field
itself (what a handler without a declared type must do); ``TypedEchoAgent`` declares the
payload as ``Work`` (``cmd: Command[Work]``), so the runtime decodes and checks it with
msgspec before the handler runs. Both emit the same event. (``EchoAgent``, a dict handler
that checks nothing, is shown beside them for scale.)

- T1, in process: the step the engine runs for each delivery (decode the envelope, decode
  the declared payload, the resource key, the handler, the outputs), over the same
  pre-built bodies, in CPU time of this process (the machine may be shared: CPU time is
  what the step costs, whatever else runs). The variants take turns, round after round;
  the median of the rounds counts.
- T2, end to end: each variant a ``meshforge run`` worker draining the same backlog of
  commands on a fresh server (as F1 in ``bench_agent.py``), in turns; the median rate of
  the rounds counts, and the worker's CPU per command is shown.

Floor for both: typed >= 0.95x the hand-checked dict.

    python benchmarks/bench_typed.py [--n 20000] [--rounds 5] [--step-rounds 15] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _agents import LABELS, bench, count_outputs, cpu_seconds
from _common import BODY_SIZE, console, machine
from _floors import floor
from _variants import CheckedEchoAgent, EchoAgent, TypedEchoAgent, command_body
from rich.table import Table

from meshforge.envelope import Outbound, decode
from meshforge.publish.publisher import Publisher
from meshforge.runtime import payloads
from meshforge.runtime.agent import Agent, Command
from meshforge.runtime.outputs import build_outputs

FLOOR = 0.95
SUBJECT = "cmd.default.bench.echo.work"
STEP_AGENTS: dict[str, type[Agent[Any]]] = {
    "mf-checked": CheckedEchoAgent,
    "mf-typed": TypedEchoAgent,
    "mf": EchoAgent,
}


def step_of(agent: Agent[Any]) -> Callable[[bytes, dict[str, str]], None]:
    """One delivery through the agent as the engine takes it (``Engine._admit``, the
    handler, ``build_outputs``), without the store and the server."""
    spec = agent.commands()["work"]
    typed = payloads.decoder(spec.payload) if spec.payload is not None else None
    state = agent.initial()

    def step(body: bytes, headers: dict[str, str]) -> None:
        env = decode(body, headers)
        if typed is not None:
            env = Command.of(env, typed.decode_body(body))
        resource = agent.resource_key(env, spec)
        outputs = spec.handler(agent, env, state)
        build_outputs(agent, env, resource, SUBJECT, outputs, state)

    return step


def measure_steps(n: int, rounds: int) -> dict[str, float]:
    """Median deliveries per CPU second of each variant's step."""
    blob = "x" * BODY_SIZE
    messages = [Outbound.of(SUBJECT, command_body(blob, 1.5)) for _ in range(n)]
    bodies = [(m.data, m.headers) for m in messages]
    steps = {kind: step_of(cls()) for kind, cls in STEP_AGENTS.items()}
    for step in steps.values():  # every decoder built and warm before the clock
        for body, headers in bodies[:200]:
            step(body, headers)
    rates: dict[str, list[float]] = {k: [] for k in steps}
    kinds = list(steps)
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            step = steps[kind]
            gc.collect()
            start = time.process_time()
            for body, headers in bodies:
                step(body, headers)
            rates[kind].append(n / (time.process_time() - start))
    return {k: statistics.median(v) for k, v in rates.items()}


async def drain_once(kind: str, n: int, work: Path) -> tuple[float, float]:
    """(commands per second, worker CPU microseconds per command) of one worker run."""
    async with bench(kind, work) as b:
        blob = "x" * BODY_SIZE
        await Publisher(b.nc.jetstream()).publish_many(
            [Outbound.of(SUBJECT, command_body(blob)) for _ in range(n)]
        )
        b.start()
        assert b.proc is not None
        first, last = await count_outputs(b, n, 600)
        return (n - 1) / (last - first), cpu_seconds(b.proc.pid) / n * 1e6


async def measure_workers(n: int, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    kinds = ["mf-checked", "mf-typed"]
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    cpus: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="meshforge-bench-typed-") as tmp:
        for r in range(rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                rate, cpu = await drain_once(kind, n, Path(tmp) / f"{kind}{r}")
                rates[kind].append(rate)
                cpus[kind].append(cpu)
                console.print(f"round {r + 1} {kind}: {rate:,.0f} cmd/s, {cpu:.0f} us CPU/cmd")
    return (
        {k: statistics.median(v) for k, v in rates.items()},
        {k: statistics.median(v) for k, v in cpus.items()},
    )


def main(n: int, rounds: int, step_n: int, step_rounds: int) -> None:
    steps = measure_steps(step_n, step_rounds)
    table = Table(
        title=f"T1: one delivery's step, {step_n:,} deliveries, median of {step_rounds} "
        f"rounds, CPU time ({machine()})"
    )
    for col in ("variant", "deliveries / CPU s", "us / delivery", "vs hand-checked"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for kind, rate in steps.items():
        table.add_row(LABELS[kind] if kind != "mf" else "MeshForge agent, dict payload not checked",
                      f"{rate:,.0f}", f"{1e6 / rate:.1f}", f"{rate / steps['mf-checked']:.2f}x")  # fmt: skip
    console.print(table)
    ratio = steps["mf-typed"] / steps["mf-checked"]
    floor("T1", "typed payload vs dict checked by hand: the engine's step per delivery (CPU time)",
          f"{ratio:.2f}x", f">= {FLOOR}x", met=ratio >= FLOOR,
          note=f"{1e6 / steps['mf-typed']:.1f} vs {1e6 / steps['mf-checked']:.1f} us a delivery")  # fmt: skip

    rates, cpus = asyncio.run(measure_workers(n, rounds))
    table = Table(
        title=f"T2: backlog of {n:,} commands through a worker, median of {rounds} ({machine()})"
    )
    for col in ("variant", "cmd/s", "worker CPU/cmd", "vs hand-checked"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for kind in rates:
        table.add_row(LABELS[kind], f"{rates[kind]:,.0f}", f"{cpus[kind]:.0f} us",
                      f"{rates[kind] / rates['mf-checked']:.2f}x")  # fmt: skip
    console.print(table)
    ratio = rates["mf-typed"] / rates["mf-checked"]
    floor("T2", "typed payload vs dict checked by hand: worker draining a backlog",
          f"{ratio:.2f}x", f">= {FLOOR}x", met=ratio >= FLOOR,
          note=f"{rates['mf-typed']:,.0f} vs {rates['mf-checked']:,.0f} cmd/s; CPU/cmd "
          f"{cpus['mf-typed']:.0f} vs {cpus['mf-checked']:.0f} us")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=20_000, help="commands per worker run (T2)")
    parser.add_argument("--rounds", type=int, default=5, help="worker runs per variant (T2)")
    parser.add_argument("--step-n", type=int, default=20_000, help="deliveries a round (T1)")
    parser.add_argument("--step-rounds", type=int, default=15, help="rounds (T1)")
    parser.add_argument("--quick", action="store_true", help="2,000 commands, fewer rounds")
    args = parser.parse_args()
    if args.quick:
        main(2_000, 1, 2_000, 3)
    else:
        main(args.n, args.rounds, args.step_n, args.step_rounds)
