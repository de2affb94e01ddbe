"""Exercise 2.5's goal: your executor's measured bubble follows the schedule's formula.

Each cell runs your schedules (``template_pipeline_schedules.py``) on your executor and messages
(``template_pipeline_executor.py``, ``template_pipeline_comm.py``) in a world of p processes, for
a few steps, and measures each stage's bubble from the events the executor records: the share
of the step (first forward of any stage to last backward or W) in which the stage was not
running a forward, a backward or a W. The formula is the papers' (p-1)/(m+p-1) for GPipe and
1F1B, (p-1)/(v·m+p-1) for interleaved 1F1B with v chunks per rank, and for the zero-bubble
schedules, whose backward is split into B (input) and W (weights) of equal cost, ZB-H1's
(p-1)/(3m+p-1) and ZB-V's (p-1)/(6m+p-1) (Qi et al. 2024; ``pipeline_study/simulation.py``).

The stages are *timed* stages (``phase2_advanced/pipeline_timed_stages.py``): each forward sleeps
``--forward-ms``, each B and each W as long (a full backward twice that; an interleaved or V
chunk a v-th of each), on tiny tensors. A sleeping stage holds no core, so four stages on a
2-core machine run as if each had its own device, and the formula's assumption (fixed costs,
messages nearly free) is what is measured. What is left is your schedule and your executor: a
schedule that serialises the stages, an executor that blocks on a send or waits for a message it
could have received earlier shows up as idle time. The zero-bubble rows run beside 1F1B at the
same (p, m) in the same run, and a line compares them.

The verdict (tests/benches/verdict.py) reads, per cell, each measured step's |mean bubble over
the stages - formula|: ``goal met`` when the middle half of those steps is within the
tolerance, ``goal not met`` when it is all outside on a machine that is not busy, and
``inconclusive`` otherwise: a sleeping stage that wakes late on a busy machine looks like a
bubble, so a busy machine cannot fail the goal, and a spread across it asks for more steps.
(``uv run torchrun ... -m solutions.phase2_advanced.demos.pipeline`` measures a real MLP,
where the machine's cores and messages decide: see the guide's measured section.)

    uv run python -m tests.bench 2.5                    # your code (the templates)
    uv run python -m tests.bench 2.5 --impl solutions   # the reference
    uv run python -m tests.bench 2.5 --quick            # p = 2 cells only
    uv run python -m tests.bench 2.5 --repeats 8        # 8 measured steps per cell

Only the TODOs of 2.5 are needed (schedules, messages, executor; not the partition). While the
zero-bubble TODOs are open, their rows are skipped with a line naming the TODO (exit status 2).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from benches import verdict
from course.cli import todo_line
from course.impl import load_impl
from course.results import Table, write_results
from course.world import RankFailed, WorldError, run_world
from phase2_advanced.pipeline_timed_stages import (
    TimedRun,
    step_bubbles,
    summarise,
    timed_run_worker,
)
from solutions.phase2_advanced.pipeline_study.simulation import formula_bubble

PHASE = "phase2_advanced"
TOLERANCE = 0.08
GOAL = (
    f"2.5: measured bubble within {TOLERANCE} of the formula ((p-1)/(m+p-1); interleaved "
    "(p-1)/(v·m+p-1); ZB-H1 (p-1)/(3m+p-1); ZB-V (p-1)/(6m+p-1)) for every schedule and (p, m), "
    "on stages of fixed cost"
)
# (schedule, p, m, v): the p = 2 cells run one process per core; p = 4 shares them (sleeping).
# Each message and each wake-up of a sleeping stage costs time the formula counts as free (on a
# busy 2-core machine, milliseconds): stages of 100 ms keep that share small, and interleaving
# runs at p = 2 only, since at p = 4 it crosses twice as many stage boundaries per step.
# The zero-bubble rows run beside 1F1B at the same (p, m); ZB-V's formula needs m >= 2p.
CELLS = [
    ("gpipe", 2, 4, 1),
    ("1f1b", 2, 4, 1),
    ("interleaved", 2, 4, 2),
    ("zb-h1", 2, 4, 1),
    ("zb-v", 2, 4, 2),
    ("gpipe", 4, 8, 1),
    ("1f1b", 4, 8, 1),
    ("zb-h1", 4, 8, 1),
]


@dataclass(frozen=True)
class Cell:
    schedule: str
    p: int
    m: int
    v: int
    forward_s: float
    steps: int
    impl: str

    def formula(self) -> float:
        return formula_bubble(self.schedule, self.p, self.m, self.v)

    def run(self) -> TimedRun:
        return TimedRun(
            self.schedule, self.p, self.m, self.v, self.forward_s, self.steps, self.impl
        )


def measure(cell: Cell) -> tuple[float, list[float], list[float]]:
    """(mean over stages of the median bubble over steps 2.., per-stage medians, and each
    measured step's mean bubble over the stages)."""
    # a step lasts about (m + p) stage forwards, B's and W's; a hang still ends
    step_seconds = (cell.m + cell.p) * 3 * cell.forward_s
    runs = run_world(
        timed_run_worker, cell.p, (cell.run(),), timeout=60.0 + 2 * cell.steps * step_seconds
    )
    result = summarise(runs)
    per_step = [
        statistics.fmean(step_bubbles([run[step] for run in runs]))
        for step in range(1, len(runs[0]))
    ]
    return result.mean_bubble, result.bubbles, per_step


def unwritten_schedules(impl: str) -> dict[str, str]:
    """Build every schedule in this process first: an unwritten schedule TODO is one line here,
    not one per rank. Returns {schedule name: the TODO line} for the zero-bubble schedules that
    cannot be built yet; raises NotImplementedError for the others (1F1B's TODOs come first)."""
    schedules = load_impl(PHASE, "pipeline_schedules", impl)
    missing = {}
    for name, p, m, v in CELLS:
        try:
            schedules.make_schedule(name, p, m, v)
        except NotImplementedError as exc:
            if not name.startswith("zb-"):
                raise
            missing[name] = todo_line(exc)
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    parser = verdict.parser(__doc__.split("\n\n")[0], repeats=3)
    parser.add_argument(
        "--forward-ms", type=float, default=100.0, help="sleep of one stage's forward (default 100)"
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="steps per cell; the first is a warm-up"
    )
    parser.add_argument(
        "--record", default="", help="also write the table to this results file (JSON)"
    )
    args = parser.parse_args(argv)
    if args.repeats is not None:  # measured steps, after the warm-up
        args.steps = args.repeats + 1
    if not 1.0 <= args.forward_ms <= 1000.0:
        print(f"error: --forward-ms {args.forward_ms}: use 1 to 1000 (ms)", file=sys.stderr)
        return 2
    if not 2 <= args.steps <= 50:
        print(
            f"error: --steps {args.steps}: use 2 to 50 (the first step is a warm-up)",
            file=sys.stderr,
        )
        return 2
    cells = [c for c in CELLS if not args.quick or c[1] == 2]
    try:
        skipped = unwritten_schedules(args.impl)
    except NotImplementedError as exc:
        print(todo_line(exc), file=sys.stderr)
        return 2
    print(
        f"2.5 bubble ({args.impl}): stages of fixed cost, forward {args.forward_ms:g} ms, backward "
        f"{2 * args.forward_ms:g} ms per stage (split: B and W {args.forward_ms:g} ms each); "
        f"median over steps 2-{args.steps}"
    )
    header = f"{'schedule':<12}{'p':>3}{'m':>4}{'v':>3}  {'measured (per stage)':<28}{'mean':>7}"
    print(header + f"{'formula':>9}{'diff':>8}")
    worst = 0.0
    means: dict[tuple[str, int, int], tuple[float, float]] = {}
    off: dict[str, list[float]] = {}  # per cell: each measured step's |mean bubble - formula|
    table = Table(["schedule", "p", "m", "v", "measured per stage", "mean", "formula", "diff"])
    meter = verdict.LoadMeter()
    for name, p, m, v in cells:
        if name in skipped:
            continue
        cell = Cell(name, p, m, v, args.forward_ms / 1e3, args.steps, args.impl)
        try:
            with meter.running(processes=p, computing=False):  # sleeping stages add no load
                mean, per_stage, per_step = measure(cell)
        except RankFailed as err:
            line = f"{err.message.replace(':', ' not written:', 1)} (rank {err.rank})"
            if err.exc_type == "NotImplementedError" and name.startswith("zb-"):
                skipped[name] = line  # the split backward: the other rows still measure
                continue
            if err.exc_type == "NotImplementedError":
                print(line, file=sys.stderr)
                return 2
            print(f"error: {name} p={p} m={m}: {str(err).splitlines()[0]}", file=sys.stderr)
            return 2
        except WorldError as err:
            print(f"error: {name} p={p} m={m}: {str(err).splitlines()[0]}", file=sys.stderr)
            return 2
        diff = mean - cell.formula()
        worst = max(worst, abs(diff))
        off[f"{name} p={p} m={m}"] = [abs(b - cell.formula()) for b in per_step]
        means[(name, p, m)] = (mean, cell.formula())
        table.add(
            name,
            p,
            m,
            v,
            ", ".join(f"{b:.3f}" for b in per_stage),
            f"{mean:.3f}",
            f"{cell.formula():.3f}",
            f"{diff:+.3f}",
        )
        stages = " ".join(f"{b:.3f}" for b in per_stage)
        print(
            f"{name:<12}{p:>3}{m:>4}{v:>3}  {stages:<28}{mean:>7.3f}{cell.formula():>9.3f}"
            f"{diff:>+8.3f}",
            flush=True,
        )
    for line in zero_bubble_against_1f1b(means):
        print(line)
    load = meter.read()
    goal = verdict.Goal("|measured - formula| per step", TOLERANCE, at_least=False, unit="")
    judged, _ = goal.judge_cells(off, load, per="step", more=verdict.more_repeats(args.steps - 1))
    if skipped:
        print(f"on the rows measured (not {', '.join(skipped)}): {judged.line}")
        for name, line in skipped.items():
            print(f"{name} rows skipped: {line}", file=sys.stderr)
        return 2
    if args.record:
        values = {"worst": f"{worst:.3f}", "verdict": judged.line, "impl": args.impl}
        values["zero_bubble_below_1f1b"] = zero_bubble_below(means)
        values["load"] = f"{load.text()} ({'busy' if load.busy else 'not busy'})"
        print(f"recorded {write_results(args.record, tables={'bubble': table}, values=values)}")
    return verdict.finish(judged)


def zero_bubble_against_1f1b(means: dict[tuple[str, int, int], tuple[float, float]]) -> list[str]:
    """One line per zero-bubble cell measured beside 1F1B at the same (p, m)."""
    lines = []
    for (name, p, m), (mean, formula) in means.items():
        one_f = means.get(("1f1b", p, m))
        if name.startswith("zb-") and one_f is not None:
            lines.append(
                f"{name} p={p} m={m}: measured {mean:.3f} against 1F1B's {one_f[0]:.3f} in the "
                f"same run (formulas {formula:.3f} and {one_f[1]:.3f})"
            )
    return lines


def zero_bubble_below(means: dict[tuple[str, int, int], tuple[float, float]]) -> str:
    """How many zero-bubble cells measured below 1F1B at the same (p, m): "k of n"."""
    pairs = [
        (mean, means[("1f1b", p, m)][0])
        for (name, p, m), (mean, _) in means.items()
        if name.startswith("zb-") and ("1f1b", p, m) in means
    ]
    return f"{sum(zb < one_f for zb, one_f in pairs)} of {len(pairs)}"


if __name__ == "__main__":
    sys.exit(main())
