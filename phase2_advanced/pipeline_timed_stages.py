"""Pipeline stages of fixed cost: measure a schedule and an executor, not a machine (given).

A bubble formula assumes each forward, backward of the input (B) and backward of the weights (W)
costs a fixed time and messages are free. On a 2-core machine running 4 processes of matrix
products that is far from true: stages wait for cores. A :class:`TimedStage` *sleeps* instead of
computing: ``forward_s`` in its forward, ``input_s`` when autograd computes the gradient of its
input, ``weight_s`` when autograd computes the gradient of its weight, on a scalar per sample. A
sleeping process holds no core, so four timed stages on two cores run as if each had its own
device, and what is measured is the schedule and the executor: whether an action waits for a
message it could have had earlier, whether the work of a stage is serialised.

The two sleeps of a backward sit on two branches of the graph (``y = sleep_B(x) * sleep_W(w)``),
so autograd walks only the branch asked for: a B (gradient of the input only) sleeps
``input_s``, a W (gradient of the weight only) ``weight_s``, a full backward both. The first
stage's input needs no gradient, so its B has nothing to compute and its W does the whole
backward, as in torch's pipelining (``stage.py``: the first stage skips the input backward): its
input branch goes through a parameter, so that W sleeps ``input_s + weight_s``.

Used by ``uv run python -m tests.bench 2.5`` and by the timeline command
``uv run python -m solutions.phase2_advanced.pipeline_study.timeline``, on the implementation chosen
by ``impl`` (your templates or the reference), through ``course.impl.load_impl``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course.events import Event, idle_fraction
from course.impl import load_impl
from phase2_advanced.pipeline_actions import BACKWARD, FORWARD, WEIGHT
from phase2_advanced.pipeline_layout import virtual_stage

PHASE = "phase2_advanced"
WORK = (FORWARD, BACKWARD, WEIGHT)  # the events that count as work in a timeline


class _SleepInForward(torch.autograd.Function):
    """Identity that sleeps ``seconds`` in its forward (its backward is free)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SleepInBackward(torch.autograd.Function):
    """Identity that sleeps ``seconds`` when autograd walks back through it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class TimedStage(nn.Module):
    """A stage that costs fixed times: forward ``forward_s``, B ``input_s``, W ``weight_s``
    (seconds). It computes ``x * weight`` (``x * scale * weight`` on the ``first`` stage, whose
    input needs no gradient: its W then walks both branches)."""

    def __init__(self, forward_s: float, input_s: float, weight_s: float, first: bool) -> None:
        super().__init__()
        self.forward_s, self.input_s, self.weight_s = forward_s, input_s, weight_s
        self.weight = nn.Parameter(torch.ones((), dtype=torch.float64))
        self.scale = nn.Parameter(torch.ones((), dtype=torch.float64)) if first else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _SleepInForward.apply(x, self.forward_s)
        if self.scale is not None:
            x = x * self.scale
        return _SleepInBackward.apply(x, self.input_s) * _SleepInBackward.apply(
            self.weight, self.weight_s
        )


@dataclass(frozen=True)
class TimedRun:
    """One schedule run on timed stages: ``p`` ranks, ``m`` micro-batches, ``v`` chunks per rank
    when interleaved; a stage's forward, B and W each sleep ``forward_s`` (a chunk's: a v-th,
    or half under zb-v); ``steps`` steps, the first a warm-up; ``impl`` is whose code runs."""

    schedule: str
    p: int
    m: int
    v: int
    forward_s: float
    steps: int
    impl: str


def timed_run_worker(run: TimedRun) -> list[list[Event]]:
    """One rank: build its timed chunks and the chosen implementation's executor, run
    ``run.steps`` steps, return each step's recorded events."""
    schedules = load_impl(PHASE, "pipeline_schedules", run.impl)
    executor_module = load_impl(PHASE, "pipeline_executor", run.impl)
    rank = dist.get_rank()
    chunks_here = schedules.chunks_per_rank(run.schedule, run.v)
    placement = schedules.placement_of(run.schedule)
    cost = run.forward_s / chunks_here
    chunks = [
        TimedStage(cost, cost, cost, first=virtual_stage(rank, c, run.p, placement) == 0)
        for c in range(chunks_here)
    ]
    actions = schedules.make_schedule(run.schedule, run.p, run.m, run.v)[rank]
    executor = executor_module.PipelineExecutor(
        chunks, actions, run.m, F.mse_loss, placement=placement
    )
    inputs = torch.ones(2 * run.m, 4, dtype=torch.float64)
    targets = torch.zeros(2 * run.m, 4, dtype=torch.float64)
    events = []
    for _ in range(run.steps):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        dist.barrier()  # every step starts together, so the timelines share a start
        events.append(executor.step(inputs, targets).events)
    return events


def step_bubbles(events_by_rank: Sequence[Sequence[Event]]) -> list[float]:
    """Each rank's idle share of one step, from the first forward of any rank to the last
    backward or W: waiting for a message and posting a send count as idle."""
    work = [[e for e in events if e.name in WORK] for events in events_by_rank]
    start = min(e.start for events in work for e in events)
    end = max(e.end for events in work for e in events)
    return [idle_fraction(events, start, end) for events in work]


@dataclass
class TimedResult:
    """Per-stage median bubble over the measured steps (the first is a warm-up), and the
    events of the step whose mean bubble is the median (to draw)."""

    bubbles: list[float]
    median_step: list[list[Event]]

    @property
    def mean_bubble(self) -> float:
        return statistics.fmean(self.bubbles)


def summarise(events_by_rank_and_step: Sequence[Sequence[Sequence[Event]]]) -> TimedResult:
    """``events[rank][step]`` of a run -> its :class:`TimedResult` (steps 2.. measured)."""
    steps = len(events_by_rank_and_step[0])
    per_step = [[run[step] for run in events_by_rank_and_step] for step in range(1, steps)]
    bubbles = [step_bubbles(step) for step in per_step]
    order = sorted(range(len(per_step)), key=lambda i: statistics.fmean(bubbles[i]))
    ranks = len(events_by_rank_and_step)
    return TimedResult(
        [statistics.median(b[rank] for b in bubbles) for rank in range(ranks)],
        [list(events) for events in per_step[order[len(order) // 2]]],
    )
