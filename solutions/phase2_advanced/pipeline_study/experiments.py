"""Measure the real pipeline executor and draw what it did (notebooks/pipeline_bubbles.ipynb, and
the measured section of guidelines.md#25-pipeline-parallelism).

Worker functions live here, not in the notebook, because the ranks of :func:`run_world` unpickle
the function they run: it must be importable. Each measurement trains a few steps of the deep
MLP of ``demos.pipeline`` in a world of p processes and keeps every rank's recorded events;
the first step (which also warms caches) is left out of the statistics. The configuration's
``impl`` picks the implementation, so the notebook can draw a learner's executor too.

As a program it measures the guide's configurations and records them (``--record PATH``):

    uv run python -m solutions.phase2_advanced.pipeline_study.experiments
    uv run python -m solutions.phase2_advanced.pipeline_study.experiments \
        --record phase2_advanced/results/pipeline_bubbles.json
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from course.cli import parse_config, run_main
from course.events import Event
from course.impl import IMPLS
from course.results import Table, write_results
from course.world import WorldError, run_world
from phase2_advanced.pipeline_actions import BACKWARD, FORWARD, WEIGHT
from solutions.phase2_advanced.demos.pipeline import (
    PipelineConfig,
    PipelineRun,
    formula_bubble,
    measured_bubbles,
    run_pipeline,
    single_device_losses,
)
from solutions.phase2_advanced.pipeline_study.simulation import Simulation


@dataclass(frozen=True)
class Box:
    """One action drawn on a timeline: rank, kind, micro-batch, chunk, start and end."""

    rank: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass
class Measurement:
    """One configuration run for real: per-rank bubbles, peaks and a representative step."""

    config: PipelineConfig
    num_ranks: int
    bubbles: list[float]  # per rank, median over the measured steps
    formula: float
    peak_stashed: list[int]  # per rank: (micro-batch, chunk) activations held at once
    boxes: list[Box]  # the measured step whose mean bubble is the median one
    losses: list[float]

    @property
    def mean_bubble(self) -> float:
        return statistics.fmean(self.bubbles)

    @property
    def step_ms(self) -> float:
        """How long the drawn step took, first forward to last backward or W, in ms: a bubble
        is a share of it, so a schedule that adds work can idle a smaller share of a longer
        step."""
        return 1e3 * (max(b.end for b in self.boxes) - min(b.start for b in self.boxes))

    @property
    def peak_stage_equivalents(self) -> list[float]:
        """Peak stash in whole stages' worth of activations: an interleaved chunk is a v-th of a
        rank's layers, so v stashed (micro-batch, chunk) pairs hold about what one micro-batch
        through a whole stage holds under GPipe or 1F1B."""
        v = self.config.num_chunks
        return [peak / v for peak in self.peak_stashed]


def pipeline_run_worker(config: PipelineConfig) -> PipelineRun:
    """What each rank runs: ``run_pipeline`` inside the world's process group."""
    return run_pipeline(config)


def boxes_from_events(events_by_rank: Sequence[Sequence[Event]]) -> list[Box]:
    """Forward, backward and W events of every rank, times in seconds from the step's first
    action."""
    work = [
        [e for e in events if e.name in (FORWARD, BACKWARD, WEIGHT)] for events in events_by_rank
    ]
    origin = min(e.start for events in work for e in events)
    return [
        Box(
            rank,
            e.name,
            e.labels["microbatch"],
            e.labels["chunk"],
            e.start - origin,
            e.end - origin,
        )
        for rank, events in enumerate(work)
        for e in events
    ]


def boxes_from_simulation(simulation: Simulation) -> list[Box]:
    """The simulated timelines as boxes (times in units of one forward)."""
    return [
        Box(rank, t.action.kind, t.action.microbatch, t.action.chunk, t.start, t.end)
        for rank, line in enumerate(simulation.timelines)
        for t in line
    ]


# A measurement trains for seconds to a minute on a busy 2-core machine: longer than the world
# timeout that tests use (DTFS_WORLD_TIMEOUT, 20 s by default). A hang is still reported.
MEASURE_TIMEOUT = 300.0


def measure(config: PipelineConfig, num_ranks: int) -> Measurement:
    """Run ``config`` on a world of ``num_ranks`` processes and summarise what they recorded."""
    if config.steps < 2:
        raise ValueError("measure at least 2 steps: the first one also warms caches")
    runs: list[PipelineRun] = run_world(
        pipeline_run_worker, num_ranks, (config,), timeout=MEASURE_TIMEOUT
    )
    per_step = [[run.events[step] for run in runs] for step in range(1, config.steps)]
    step_bubbles = [measured_bubbles(step) for step in per_step]
    order = sorted(range(len(per_step)), key=lambda i: statistics.fmean(step_bubbles[i]))
    median_step = order[len(order) // 2]
    return Measurement(
        config=config,
        num_ranks=num_ranks,
        bubbles=[statistics.median(b[rank] for b in step_bubbles) for rank in range(num_ranks)],
        formula=formula_bubble(config, num_ranks),
        peak_stashed=[run.peak_stashed for run in runs],
        boxes=boxes_from_events(per_step[median_step]),
        losses=runs[0].losses,
    )


def sweep(
    config: PipelineConfig, num_ranks: int, field: str, values: Sequence[Any]
) -> list[Measurement]:
    """``measure`` once per value of one config field (say ``microbatches``)."""
    return [measure(replace(config, **{field: value}), num_ranks) for value in values]


# ----------------------------------------------------------------------------- drawing

FORWARD_COLORS = ("#9ecae1", "#a1d99b", "#fdd0a2")  # chunk 0, 1, 2: light
BACKWARD_COLORS = ("#3182bd", "#31a354", "#e6550d")  # chunk 0, 1, 2: dark
WEIGHT_COLORS = ("#c6dbef", "#c7e9c0", "#fee6ce")  # chunk 0, 1, 2: lightest, hatched
PALETTES = {FORWARD: FORWARD_COLORS, BACKWARD: BACKWARD_COLORS, WEIGHT: WEIGHT_COLORS}


def draw_timeline(ax: Any, boxes: Sequence[Box], title: str, unit: str = "ms") -> None:
    """One row per rank (rank 0 on top); forwards light, backwards (B) dark, weight passes (W)
    lightest and hatched, one hue per chunk; white is idle. Each box is labelled with its
    micro-batch when it is wide enough. ``unit`` is "ms" for measured boxes (seconds) or
    "forward" for simulated ones."""
    # matplotlib is imported here, not by the module: every rank of a measured world imports
    # this module to find its worker function, and matplotlib costs it about 0.4 s of CPU
    from matplotlib.patches import Patch

    scale = 1e3 if unit == "ms" else 1.0
    ranks = 1 + max(box.rank for box in boxes)
    chunks = 1 + max(box.chunk for box in boxes)
    end = max(box.end for box in boxes) * scale
    for box in boxes:
        palette = PALETTES[box.kind]
        start, width = box.start * scale, (box.end - box.start) * scale
        y = ranks - 1 - box.rank
        color = palette[box.chunk % len(palette)]
        ax.broken_barh(
            [(start, width)],
            (y - 0.4, 0.8),
            facecolors=color,
            edgecolor="black",
            lw=0.4,
            hatch="//" if box.kind == WEIGHT else None,
        )
        if width > end / 60:
            ink = "white" if box.kind == BACKWARD else "black"
            ax.text(
                start + width / 2,
                y,
                str(box.microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color=ink,
            )
    handles = []
    kinds = [kind for kind in PALETTES if any(box.kind == kind for box in boxes)]
    names = {FORWARD: "forward (F)", BACKWARD: "backward (B)", WEIGHT: "weights (W)"}
    for chunk in range(chunks):
        suffix = f", chunk {chunk}" if chunks > 1 else ""
        for kind in kinds:
            color = PALETTES[kind][chunk % len(PALETTES[kind])]
            hatch = "//" if kind == WEIGHT else None
            handles.append(
                Patch(facecolor=color, edgecolor="black", hatch=hatch, label=names[kind] + suffix)
            )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"stage {r}" for r in reversed(range(ranks))])
    ax.set_xlim(0, end)
    ax.set_xlabel("time (ms)" if unit == "ms" else "time (one forward = 1)")
    ax.set_title(title, fontsize=10)


# ----------------------------------------------------------------------------- the program

# (schedule, p, m): the guide's measured table; interleaved and zb-v run 2 chunks per rank
GUIDE_RUNS = [
    ("gpipe", 2, 8),
    ("1f1b", 2, 8),
    ("1f1b", 2, 16),
    ("interleaved", 2, 8),
    ("zb-h1", 2, 8),
    ("zb-v", 2, 8),
    ("gpipe", 4, 8),
    ("1f1b", 4, 8),
    ("interleaved", 4, 8),
    ("zb-h1", 4, 8),
    ("zb-v", 4, 8),
]


@dataclass
class ExperimentConfig:
    """The model every configuration of :data:`GUIDE_RUNS` trains (``demos.pipeline``'s)."""

    microbatch_size: int = field(default=32, metadata={"ge": 1, "fix": "e.g. 32 samples"})
    steps: int = field(
        default=4,
        metadata={"ge": 2, "fix": "at least 2 steps (the first one warms up), e.g. 4"},
    )
    depth: int = field(default=8, metadata={"ge": 1, "fix": "e.g. --depth 8"})
    width: int = field(default=512, metadata={"ge": 1, "fix": "e.g. --width 512"})
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference or your phase2_advanced templates"},
    )
    record: str = field(
        default="", metadata={"help": "also write the tables to this results file (JSON)"}
    )


def guide_tables(measurements: Sequence[Measurement]) -> tuple[Table, Table, dict[str, str]]:
    """The bubble table, the peak-stash table, and the values the guide's prose quotes (each
    computed here, so a re-run cannot contradict the page)."""
    bubbles = Table(
        ["schedule", "p", "m", "measured bubble per stage", "mean", "formula", "step (ms)"]
    )
    peaks = Table(["schedule", "p", "m", "peak stashed per stage", "stages' worth"])
    for run in measurements:
        name, p, m = run.config.schedule, run.num_ranks, run.config.microbatches
        label = f"interleaved, v = {run.config.chunks}" if name == "interleaved" else name
        label = "zb-v, 2 chunks in a V" if name == "zb-v" else label
        bubbles.add(
            label,
            p,
            m,
            ", ".join(f"{b:.3f}" for b in run.bubbles),
            f"{run.mean_bubble:.3f}",
            f"{run.formula:.3f}",
            f"{run.step_ms:.0f}",
        )
        peaks.add(
            label,
            p,
            m,
            ", ".join(str(x) for x in run.peak_stashed),
            ", ".join(f"{x:g}" for x in run.peak_stage_equivalents),
        )
    above = sum(run.mean_bubble > run.formula for run in measurements)
    by_key = {(r.config.schedule, r.num_ranks, r.config.microbatches): r for r in measurements}
    values = {
        "above_formula": f"{above} of {len(measurements)}",
        "max_loss_diff": f"{max(diff for run in measurements for diff in loss_diffs(run)):.1e}",
    }
    pairs = [
        (key, by_key[("1f1b", key[1], key[2])])
        for key in by_key
        if key[0] == "interleaved" and ("1f1b", key[1], key[2]) in by_key
    ]
    higher = sum(by_key[key].mean_bubble > one_f.mean_bubble for key, one_f in pairs)
    values["interleaved_higher"] = f"{higher} of {len(pairs)}"
    zero_bubble = [
        (by_key[key], by_key[("1f1b", key[1], key[2])])
        for key in by_key
        if key[0].startswith("zb-") and ("1f1b", key[1], key[2]) in by_key
    ]
    below = sum(zb.mean_bubble < one_f.mean_bubble for zb, one_f in zero_bubble)
    values["zero_bubble_below_1f1b"] = f"{below} of {len(zero_bubble)}"
    small, large = by_key.get(("1f1b", 2, 8)), by_key.get(("1f1b", 2, 16))
    if small is not None and large is not None:
        values["one_f_m8_m16"] = (
            f"{small.mean_bubble:.3f} at m = 8 and {large.mean_bubble:.3f} at m = 16"
        )
    return bubbles, peaks, values


def loss_diffs(run: Measurement) -> list[float]:
    """|pipeline loss - single-device loss| per step."""
    reference = single_device_losses(run.config)
    return [abs(a - b) for a, b in zip(run.losses, reference, strict=True)]


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(ExperimentConfig, argv, __doc__)
    model = PipelineConfig(
        microbatch_size=config.microbatch_size,
        steps=config.steps,
        depth=config.depth,
        width=config.width,
        impl=config.impl,
        balance="params",
        chunks=2,
    )
    started = time.perf_counter()
    measurements = []
    try:
        for name, p, m in GUIDE_RUNS:
            run_config = replace(model, schedule=name, microbatches=m)
            measurements.append(measure(run_config, p))
            print(f"measured {name} p={p} m={m}", file=sys.stderr, flush=True)
    except WorldError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    bubbles, peaks, values = guide_tables(measurements)
    seconds = time.perf_counter() - started
    print(bubbles.to_markdown(), "", peaks.to_markdown(), sep="\n")
    print(f"\n({seconds:.0f} s)")
    if config.record:
        values["seconds"] = f"{seconds:.0f} s"
        path = write_results(
            config.record, tables={"bubbles": bubbles, "peaks": peaks}, values=values
        )
        print(f"recorded {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
