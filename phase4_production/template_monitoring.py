# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase4.py
"""Exercise 4.5: where each rank's step goes, how much of the machine it uses, and who is slow.

Three measurements answer the questions asked of every slow training run:

* **Where does the step go?** :class:`StepTimer` splits each optimizer step into the sections the
  training loop announces (course/training.py: ``data``, ``forward``, ``backward``,
  ``sync``, ``optimizer``, ``other``). The sections tile the step: each timing point closes the
  section that ran since the previous one, so they never overlap and always add up to the step.
  On a GPU, kernels run asynchronously, and each section must still be credited with the
  kernels it queued.
* **How much of the machine does it use?** Model FLOPs utilization (MFU, Chowdhery et al., PaLM,
  2022, appendix B): the FLOPs the model needs per step, counted by
  ``torch.utils.flop_counter.FlopCounterMode``, divided by the step time and the device's peak
  FLOP/s (phase4_production/device_peaks.py).
  Recomputation (activation checkpointing) is not counted: that would be hardware FLOPs (HFU).
* **Who is slow?** A synchronous job runs at the speed of its slowest rank, and the others wait
  for it inside the next collective, so every rank's *total* step time is the same. What differs
  is the time a rank spends *not* waiting on the others. Every N steps each rank's median of that
  over its last N steps is compared with the median across ranks, and a rank slower than
  ``threshold`` x that is named, the same list on every rank. NVIDIA's detector
  (nvidia-resiliency-ext, ``nvidia_resiliency_ext.straggler``) times marked sections per rank
  the same way and scores each rank against the *fastest* rank and against its own best;
  Megatron-LM's ``StragglerDetector`` (megatron/core/utils.py) gathers per-rank CUDA-event
  timings and reports the slowest and fastest ranks. The median is the sturdier reference: one
  unusually fast rank (a smaller last batch, an idle neighbour) does not make the others slow.

The callback that wires these into the training loop, TensorBoard, a JSONL file, the profiler and
a progress bar is given: phase4_production/training_monitor.py.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

# ----------------------------------------------------------------------------- the step breakdown


@dataclass
class StepTimes:
    """One step on this rank: seconds per section, and the whole step (their sum)."""

    total: float
    sections: dict[str, float] = field(default_factory=dict)


class StepTimer:
    """Wall-clock seconds of each section of one step, on this rank.

    ``start()`` when the step begins (before the batch is drawn), ``mark(section)`` at every timing
    point (the section that just ended), ``finish()`` at the end. A section marked several times
    in one step (forward and backward, once per micro-batch) adds up.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.started = 0.0  # the clock at start()
        self.last = 0.0  # the clock at the latest timing point
        self.sections: dict[str, float] = {}

    def start(self) -> None:
        """The step begins now: forget the previous step's sections."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the previous step's kernels are not ours
        self.sections = {}
        self.started = self.last = time.perf_counter()

    def mark(self, section: str) -> None:
        """``section`` has just ended: add the time since the previous timing point to it."""
        # TODO 4.5: close the section that ran since the previous timing point.
        # Invariant: the sections tile the step: no gap, no overlap, so their sum is the time from
        #   start() to the latest mark; a section marked twice in a step adds up; on CUDA, the time
        #   includes the kernels the section queued.
        # Hint 1: the host queues kernels and goes on; the clock is the host's.
        # More hints: uv run python -m tests.hint 4.5
        # See guidelines.md#45-monitoring-and-profiling
        raise NotImplementedError(
            "TODO 4.5: close the section that ran since the previous timing point "
            "(see phase4_production/guidelines.md#45-monitoring-and-profiling)"
        )

    def finish(self) -> StepTimes:
        """The step as measured: from start() to the latest timing point."""
        return StepTimes(self.last - self.started, dict(self.sections))


# ----------------------------------------------------------------------------- FLOPs and MFU


def _scratch_copy(model: nn.Module) -> nn.Module:
    """A copy to count on: counting runs a real backward (gradients, BatchNorm statistics)."""
    inner = getattr(model, "module", model)  # DistributedDataParallel wraps the model
    return copy.deepcopy(inner).train()


def count_training_flops(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    loss_fn: Callable[[Any], torch.Tensor],
) -> float:
    """FLOPs of one training step of ``model`` on ``example_inputs``: forward + backward.

    ``example_inputs`` is one step's batch on this rank (all its micro-batches), as a tensor or a
    tuple of the model's positional inputs; ``loss_fn(output)`` makes the scalar loss (e.g.
    ``lambda out: F.cross_entropy(out, targets)``). Counted once, on a copy of the model, so the
    model's parameters, gradients and buffers are left as they were; the optimizer's FLOPs (a
    few per parameter) are not counted, as in PaLM's and Megatron's MFU.
    """
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    scratch = _scratch_copy(model)
    gpus = sorted({p.device.index or 0 for p in scratch.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=gpus):  # dropout in the copy draws from forked generators
        # TODO 4.5: count the FLOPs of one forward and one backward, once each.
        # Invariant: the total is what FlopCounterMode reports for forward and backward of this
        #   batch on the scratch copy, nothing more and nothing less; the caller's model untouched.
        # Hint 1: torch.utils.flop_counter.FlopCounterMode counts the FLOPs of whatever runs while
        #   it is active and tells its total afterwards.
        # More hints: uv run python -m tests.hint 4.5
        # See guidelines.md#45-monitoring-and-profiling
        raise NotImplementedError(
            "TODO 4.5: count the FLOPs of one forward and one backward, once each "
            "(see phase4_production/guidelines.md#45-monitoring-and-profiling)"
        )


def model_flops_utilization(flops_per_step: float, step_seconds: float, peak_flops: float) -> float:
    """MFU: the share of the device's peak that the model's own FLOPs used, in [0, 1].

    ``flops_per_step``: this rank's training FLOPs per optimizer step (:func:`count_training_flops`
    on its batch); ``step_seconds``: the whole step (data, compute, waiting, optimizer: MFU is a
    throughput); ``peak_flops``: the device's dense peak in FLOP/s (:func:`peak_flops_per_second`).
    """
    if step_seconds <= 0 or peak_flops <= 0:
        raise ValueError(
            f"step_seconds={step_seconds}, peak_flops={peak_flops}: both must be positive"
        )
    # TODO 4.5: the model FLOPs achieved per second, as a fraction of the device's peak.
    # Invariant: a fraction without unit: a step whose FLOPs ran at the peak for its whole duration
    #   is 1.0, one that took twice as long is 0.5.
    # Hint 1: the arguments are plain FLOPs, seconds and FLOP/s (no tera, no milli).
    # More hints: uv run python -m tests.hint 4.5
    # See guidelines.md#45-monitoring-and-profiling
    raise NotImplementedError(
        "TODO 4.5: the model FLOPs achieved per second, as a fraction of the device's peak "
        "(see phase4_production/guidelines.md#45-monitoring-and-profiling)"
    )


# ----------------------------------------------------------------------------- stragglers


@dataclass(frozen=True)
class Straggler:
    """A rank whose median step (time not waiting on the others) is above the threshold."""

    rank: int  # global rank
    seconds: float  # its median over the window
    median_seconds: float  # the median of the ranks' medians, across the group
    threshold: float

    @property
    def ratio(self) -> float:
        return self.seconds / self.median_seconds if self.median_seconds > 0 else float("inf")

    def __str__(self) -> str:
        return (
            f"rank {self.rank} is a straggler: median step {1e3 * self.seconds:.1f} ms vs "
            f"{1e3 * self.median_seconds:.1f} ms across ranks "
            f"({self.ratio:.1f}x > {self.threshold:.1f}x)"
        )


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor handed to a collective of ``group`` must live: the GPU under NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def find_stragglers(
    window_seconds: Sequence[float],
    *,
    threshold: float = 1.5,
    group: dist.ProcessGroup | None = None,
) -> list[Straggler]:
    """The ranks of ``group`` that are slower than ``threshold`` x the median rank.

    Collective: every rank of ``group`` calls it at the same step with its own last N step times
    (seconds not spent waiting on the others) and gets the same list, sorted by global rank.
    "Median" is ``torch.median``'s, the lower of the two middle values for an even count: in a
    world of 2 the slower rank is compared with the faster one, not with their average (which it
    would pull halfway to itself).
    """
    if not window_seconds:
        raise ValueError("window_seconds is empty: time at least one step before checking")
    if threshold <= 1.0:
        raise ValueError(f"threshold={threshold}: must be > 1 (x the median rank's step)")
    # TODO 4.5: name the ranks whose median step is above threshold x the median across ranks.
    # Invariant: every rank of the group returns the same list, sorted by global rank; one slow step
    #   (a hiccup) in a rank's window makes no straggler; ranks with normal noise are not named; the
    #   fastest rank is never named for being fast.
    # Hint 1: a rank knows only its own times, and the rule compares every rank with the others.
    # More hints: uv run python -m tests.hint 4.5
    # See guidelines.md#45-monitoring-and-profiling
    raise NotImplementedError(
        "TODO 4.5: name the ranks whose median step is above threshold x the median across ranks "
        "(see phase4_production/guidelines.md#45-monitoring-and-profiling)"
    )
