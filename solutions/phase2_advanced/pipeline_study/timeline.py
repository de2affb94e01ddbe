"""Draw the timeline of your own pipeline run: what each stage did, and its bubble by the formula.

One command runs a schedule on an executor in a world of processes (``run_world``, no torchrun
needed), records the events the executor keeps (``course/events.py``), and writes a picture: one
row per stage, forwards light, backwards dark, weight passes (W) hatched, idle time white; under
it the same schedule on paper (the unit-cost simulation the formula describes). It prints each
stage's measured bubble next to the formula::

    uv run python -m solutions.phase2_advanced.pipeline_study.timeline \
        --schedule zb-h1 --impl templates --out timeline.png
    uv run python -m solutions.phase2_advanced.pipeline_study.timeline \
        --schedule 1f1b --ranks 4 --microbatches 8
    uv run python -m solutions.phase2_advanced.pipeline_study.timeline --schedule zb-v --stages mlp

``--impl templates`` (the default) runs your schedules, messages and executor; ``--impl
solutions`` the reference. ``--stages timed`` (the default) runs stages of fixed cost that sleep
(``phase2_advanced/pipeline_timed_stages.py``: forward, B and W ``--forward-ms`` each), so the
picture shows the schedule and your executor, not this machine's cores; ``--stages mlp`` runs the
demo's deep MLP (``demos/pipeline.py``), where messages and shared cores show too. The drawn
step is the one whose mean bubble is the median of steps 2 to ``--steps`` (the first warms up).
Every flag is checked before any process starts.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from course.cli import parse_config, run_main, todo_line
from course.impl import IMPLS, load_impl
from course.world import RankFailed, WorldError, run_world
from phase2_advanced.pipeline_timed_stages import (
    TimedRun,
    summarise,
    timed_run_worker,
)
from solutions.phase2_advanced.demos.pipeline import (
    PipelineConfig,
    validate_config,
)
from solutions.phase2_advanced.pipeline_schedules import (
    SCHEDULE_NAMES,
    ZERO_BUBBLE_NAMES,
    chunks_per_rank,
    placement_of,
)
from solutions.phase2_advanced.pipeline_study.experiments import (
    boxes_from_events,
    boxes_from_simulation,
    draw_timeline,
    measure,
)
from solutions.phase2_advanced.pipeline_study.simulation import (
    formula_bubble,
    simulate,
)

PHASE = "phase2_advanced"
STAGES = ("timed", "mlp")


@dataclass
class TimelineConfig:
    """One run to draw."""

    schedule: str = field(default="zb-h1", metadata={"choices": SCHEDULE_NAMES})
    ranks: int = field(
        default=2,
        metadata={"help": "p, processes", "ge": 1, "le": 8, "fix": "1 to 8, e.g. --ranks 2"},
    )
    microbatches: int = field(
        default=4,
        metadata={"help": "m, micro-batches per step", "ge": 1, "le": 64, "fix": "e.g. 4"},
    )
    chunks: int = field(
        default=2,
        metadata={"help": "v, chunks per rank (interleaved)", "ge": 1, "le": 8, "fix": "e.g. 2"},
    )
    stages: str = field(
        default="timed",
        metadata={"choices": STAGES, "help": "sleeping stages of fixed cost, or the demo's MLP"},
    )
    forward_ms: float = field(
        default=50.0,
        metadata={
            "help": "timed stages: one stage's forward, B and W each",
            "ge": 1,
            "le": 1000,
            "fix": "1 to 1000 ms, e.g. --forward-ms 50",
        },
    )
    steps: int = field(
        default=3,
        metadata={"ge": 2, "le": 20, "fix": "2 to 20 (the first step warms up), e.g. 3"},
    )
    impl: str = field(
        default="templates",
        metadata={"choices": IMPLS, "help": "your phase2_advanced templates, or the reference"},
    )
    out: str = field(default="timeline.png", metadata={"help": "the picture to write (.png)"})


def validate(config: TimelineConfig) -> None:
    """Refuse what cannot run, every problem at once, before any process starts."""
    problems = []
    if not config.out.endswith(".png"):
        problems.append(f"--out {config.out}: the picture is a PNG, name it e.g. timeline.png")
    elif not Path(config.out).resolve().parent.is_dir():
        problems.append(f"--out {config.out}: the folder {Path(config.out).parent} does not exist")
    try:
        validate_config(mlp_config(config), config.ranks)
    except ValueError as err:
        problems.append(str(err))
    if problems:
        raise ValueError("; ".join(problems))


def mlp_config(config: TimelineConfig) -> PipelineConfig:
    """The demo's run for ``--stages mlp`` (also checks the schedule's sizes for timed stages)."""
    return PipelineConfig(
        schedule=config.schedule,
        microbatches=config.microbatches,
        chunks=config.chunks,
        steps=config.steps,
        impl=config.impl,
    )


@dataclass
class Drawn:
    """What one run gives: the boxes of the drawn step, and each stage's median bubble."""

    boxes: list
    bubbles: list[float]


def run(config: TimelineConfig) -> Drawn:
    """Run the world and summarise it (WorldError when a rank fails or hangs)."""
    if config.stages == "mlp":
        measured = measure(mlp_config(config), config.ranks)
        return Drawn(measured.boxes, measured.bubbles)
    timed = TimedRun(
        config.schedule,
        config.ranks,
        config.microbatches,
        config.chunks,
        config.forward_ms / 1e3,
        config.steps,
        config.impl,
    )
    step_seconds = 3 * (config.microbatches + config.ranks) * config.forward_ms / 1e3
    events = run_world(
        timed_run_worker, config.ranks, (timed,), timeout=60 + 2 * config.steps * step_seconds
    )
    result = summarise(events)
    return Drawn(boxes_from_events(result.median_step), result.bubbles)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(TimelineConfig, argv, __doc__)
    try:
        validate(config)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # build the schedule here first: an unwritten schedule TODO is one line, not one per rank
    schedules = load_impl(PHASE, "pipeline_schedules", config.impl)
    schedule = schedules.make_schedule(
        config.schedule, config.ranks, config.microbatches, config.chunks
    )
    try:
        drawn = run(config)
    except RankFailed as err:
        if err.exc_type == "NotImplementedError":
            print(todo_line(NotImplementedError(err.message)), file=sys.stderr)
            print(f"  at {err.frames[-1]}" if err.frames else "", file=sys.stderr)
            return 2
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    except WorldError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    p, m = config.ranks, config.microbatches
    formula = formula_bubble(config.schedule, p, m, config.chunks)
    mean = sum(drawn.bubbles) / len(drawn.bubbles)
    what = "timed stages" if config.stages == "timed" else "the demo's MLP"
    print(f"{config.schedule}, p={p}, m={m}, {what}, --impl {config.impl}")
    for rank, bubble in enumerate(drawn.bubbles):
        print(f"stage {rank}: measured bubble {bubble:.3f}  formula {formula:.3f}")
    print(f"mean: measured {mean:.3f}  formula {formula:.3f}  ({mean - formula:+.3f})")
    if config.schedule in ZERO_BUBBLE_NAMES:
        print("(zero-bubble formula: F, B and W of equal cost, as the timed stages are)")
    paper = simulate(schedule, 1.0, 2.0, placement=placement_of(config.schedule))
    import matplotlib  # here: a grader imports this module, and pyplot costs 0.5 s to import

    matplotlib.use("Agg")  # a file, not a window: this may run without a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(13, 1.2 + 1.1 * p), constrained_layout=True)
    label = f"{config.schedule}, p={p}, m={m}"
    if chunks_per_rank(config.schedule, config.chunks) > 1:
        label += f", {chunks_per_rank(config.schedule, config.chunks)} chunks per rank"
    draw_timeline(
        axes[0],
        drawn.boxes,
        f"{label}, {what}, --impl {config.impl}: measured bubble {mean:.3f} (formula "
        f"{formula:.3f})",
    )
    draw_timeline(
        axes[1],
        boxes_from_simulation(paper),
        f"the same schedule on paper (a forward, a B and a W cost 1 each; a full backward 2): "
        f"bubble {paper.bubble_fraction(0):.3f}",
        unit="forward",
    )
    fig.savefig(config.out, dpi=110)
    plt.close(fig)
    print(f"wrote {config.out}")
    return 0


if __name__ == "__main__":
    run_main(main)
