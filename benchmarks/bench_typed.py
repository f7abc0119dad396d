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
  the ratio is the median over the rounds of typed / hand-checked in the same round. The
  pieces that differ are timed apart too (the typed decode, ``Command.of``, the checks).
- T2, end to end: each variant a ``meshforge run`` worker draining the same backlog of
  commands on a fresh server (as F1 in ``bench_agent.py``), in turns. The ratio is the
  worker's CPU per command, hand-checked / typed within a round, median of the rounds: on
  a shared machine the rate of one run swings by 2x with what else runs (and a slow run
  sends more ``in_progress``), the CPU a command costs much less. The rates are shown.

Floor for both: typed >= 0.95x the hand-checked dict.

    python benchmarks/bench_typed.py [--n 20000] [--rounds 7] [--step-rounds 41] [--quick]
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
from _variants import CheckedEchoAgent, Echo, EchoAgent, TypedEchoAgent, Work, command_body
from rich.table import Table

from meshforge.envelope import Outbound, decode
from meshforge.publish.publisher import Publisher
from meshforge.runtime import payloads
from meshforge.runtime.agent import Agent, Command
from meshforge.runtime.step import Step, failure_policy
from meshforge.transport.sizes import SizeLimits

FLOOR = 0.95
SUBJECT = "cmd.default.bench.echo.work"
STEP_AGENTS: dict[str, type[Agent[Any]]] = {
    "mf-checked": CheckedEchoAgent,
    "mf-typed": TypedEchoAgent,
    "mf": EchoAgent,
}


def step_of(agent: Agent[Any]) -> Callable[[bytes, dict[str, str]], None]:
    """One delivery through the agent's handler step as a worker runs it (the consumer's
    envelope decode, then ``runtime.step.Step``: the declared payload's decode, the key, the
    handler, the outputs and their size check), without the store and the server."""
    step = Step(agent, failure_policy(agent, 5, ()), handler_timeout=300.0)
    spec = agent.commands()["work"]
    state = agent.initial()
    limits = SizeLimits()

    def run(body: bytes, headers: dict[str, str]) -> None:
        cmd, resource = step.prepare(spec, decode(body, headers), body)
        done = step.run(spec, cmd, resource, SUBJECT, state, limits)
        try:  # a plain-function handler never waits: the coroutine ends at its first step
            done.send(None)
        except StopIteration:
            return
        raise RuntimeError("the handler step waited for something")

    return run


def measure_steps(n: int, rounds: int) -> tuple[dict[str, float], float]:
    """Median deliveries per CPU second of each variant's step, and the median over the
    rounds of typed / hand-checked within a round (the two ran back to back, so a slower
    spell of a shared machine weighs on both)."""
    blob = "x" * BODY_SIZE
    messages = [Outbound.of(SUBJECT, command_body(blob, 1.5)) for _ in range(n)]
    bodies = [(m.data, m.headers) for m in messages]
    steps = {kind: step_of(cls()) for kind, cls in STEP_AGENTS.items()}
    for step in steps.values():  # every decoder built and warm before the clock
        for body, headers in bodies[:200]:
            step(body, headers)
    rates: dict[str, list[float]] = {k: [] for k in steps}
    ratios: list[float] = []
    kinds = list(steps)
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            step = steps[kind]
            gc.collect()
            start = time.process_time()
            for body, headers in bodies:
                step(body, headers)
            rates[kind].append(n / (time.process_time() - start))
        ratios.append(rates["mf-typed"][-1] / rates["mf-checked"][-1])
    return {k: statistics.median(v) for k, v in rates.items()}, statistics.median(ratios)


def parts(rounds: int = 15, number: int = 5000) -> dict[str, float]:
    """Microseconds of the pieces that differ between the two steps (median of rounds)."""
    body = Outbound.of(SUBJECT, command_body("x" * BODY_SIZE, 1.5)).data
    env = decode(body)
    typed = payloads.decoder(Work)
    work = typed.decode_body(body)
    checked = CheckedEchoAgent()
    spec = checked.commands()["work"]
    pieces: dict[str, Callable[[], object]] = {
        "typed: payload decoded into Work (decode_body)": lambda: typed.decode_body(body),
        "typed: Command.of (the envelope's fields copied)": lambda: Command.of(env, work),
        "dict: the handler, checks included": lambda: spec.handler(checked, env, Echo()),
    }
    times: dict[str, list[float]] = {k: [] for k in pieces}
    for _ in range(rounds):
        for name, piece in pieces.items():
            start = time.process_time()
            for _ in range(number):
                piece()
            times[name].append((time.process_time() - start) / number * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


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


async def measure_workers(n: int, rounds: int) -> tuple[dict[str, float], dict[str, float], float]:
    """Median rate and worker CPU per command of each variant, and the median over the
    rounds of hand-checked CPU / typed CPU within a round."""
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
    ratios = [c / t for c, t in zip(cpus["mf-checked"], cpus["mf-typed"], strict=True)]
    return (
        {k: statistics.median(v) for k, v in rates.items()},
        {k: statistics.median(v) for k, v in cpus.items()},
        statistics.median(ratios),
    )


def main(n: int, rounds: int, step_n: int, step_rounds: int) -> None:
    steps, ratio = measure_steps(step_n, step_rounds)
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
    for name, us in parts().items():
        console.print(f"  {name}: {us:.2f} us")
    floor("T1", "typed payload vs dict checked by hand: the handler step per delivery (CPU time)",
          f"{ratio:.3f}x", f">= {FLOOR}x", met=ratio >= FLOOR,
          note=f"{1e6 / steps['mf-typed']:.1f} vs {1e6 / steps['mf-checked']:.1f} us a delivery")  # fmt: skip

    rates, cpus, ratio = asyncio.run(measure_workers(n, rounds))
    table = Table(
        title=f"T2: backlog of {n:,} commands through a worker, median of {rounds} ({machine()})"
    )
    for col in ("variant", "cmd/s", "worker CPU/cmd", "CPU vs hand-checked"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for kind in rates:
        table.add_row(LABELS[kind], f"{rates[kind]:,.0f}", f"{cpus[kind]:.0f} us",
                      f"{cpus['mf-checked'] / cpus[kind]:.2f}x")  # fmt: skip
    console.print(table)
    floor("T2", "typed payload vs dict checked by hand: worker draining a backlog (CPU/cmd)",
          f"{ratio:.3f}x", f">= {FLOOR}x", met=ratio >= FLOOR,
          note=f"CPU/cmd {cpus['mf-typed']:.0f} vs {cpus['mf-checked']:.0f} us; "
          f"{rates['mf-typed']:,.0f} vs {rates['mf-checked']:,.0f} cmd/s")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=20_000, help="commands per worker run (T2)")
    parser.add_argument("--rounds", type=int, default=7, help="worker runs per variant (T2)")
    parser.add_argument("--step-n", type=int, default=2_000, help="deliveries a round (T1)")
    parser.add_argument("--step-rounds", type=int, default=41, help="rounds (T1)")
    parser.add_argument("--quick", action="store_true", help="2,000 commands, fewer rounds")
    args = parser.parse_args()
    if args.quick:
        main(2_000, 1, 2_000, 5)
    else:
        main(args.n, args.rounds, args.step_n, args.step_rounds)
