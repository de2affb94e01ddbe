"""Measure the real pipeline executor and draw what it did (for notebooks/pipeline_bubbles.ipynb).

Worker functions live here, not in the notebook, because the ranks of :func:`run_world` unpickle
the function they run: it must be importable. Each measurement trains a few steps of the deep
MLP of ``pipeline_parallel`` in a world of p processes and keeps every rank's recorded events;
the first step (which also warms caches) is left out of the statistics. The configuration's
``impl`` picks the implementation, so the notebook can draw a learner's executor too.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from matplotlib.patches import Patch

from course.events import Event
from course.world import run_world
from solutions.phase2_advanced.pipeline_parallel import (
    PipelineConfig,
    PipelineRun,
    formula_bubble,
    measured_bubbles,
    run_pipeline,
)
from solutions.phase2_advanced.pipeline_schedules import BACKWARD, FORWARD
from solutions.phase2_advanced.pipeline_simulation import Simulation


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
    """Forward and backward events of every rank, times in seconds from the step's first action."""
    work = [[e for e in events if e.name in (FORWARD, BACKWARD)] for events in events_by_rank]
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


def draw_timeline(ax: Any, boxes: Sequence[Box], title: str, unit: str = "ms") -> None:
    """One row per rank (rank 0 on top); forwards light, backwards dark, one hue per chunk;
    white is idle. Each box is labelled with its micro-batch when it is wide enough.
    ``unit`` is "ms" for measured boxes (seconds) or "forward" for simulated ones."""
    scale = 1e3 if unit == "ms" else 1.0
    ranks = 1 + max(box.rank for box in boxes)
    chunks = 1 + max(box.chunk for box in boxes)
    end = max(box.end for box in boxes) * scale
    for box in boxes:
        palette = FORWARD_COLORS if box.kind == FORWARD else BACKWARD_COLORS
        start, width = box.start * scale, (box.end - box.start) * scale
        y = ranks - 1 - box.rank
        color = palette[box.chunk % len(palette)]
        ax.broken_barh(
            [(start, width)], (y - 0.4, 0.8), facecolors=color, edgecolor="black", lw=0.4
        )
        if width > end / 60:
            ink = "black" if box.kind == FORWARD else "white"
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
    for chunk in range(chunks):
        suffix = f", chunk {chunk}" if chunks > 1 else ""
        for kind, palette in ((FORWARD, FORWARD_COLORS), (BACKWARD, BACKWARD_COLORS)):
            color = palette[chunk % len(palette)]
            handles.append(Patch(facecolor=color, edgecolor="black", label=f"{kind}{suffix}"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"stage {r}" for r in reversed(range(ranks))])
    ax.set_xlim(0, end)
    ax.set_xlabel("time (ms)" if unit == "ms" else "time (one forward = 1)")
    ax.set_title(title, fontsize=10)
