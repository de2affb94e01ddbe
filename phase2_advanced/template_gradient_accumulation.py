# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase2.py
"""Exercise 2.1: gradient accumulation, a big batch in small pieces, one all-reduce per step.

Memory for activations grows with the batch. To train with an effective batch B when only
B/k fits, run k micro-batches forward and backward, let their gradients add up in ``.grad``, and
step once. Gradients are linear, so with each micro-batch's mean loss weighted by its share of
the samples, (b_1/B)·grad(mean_1) + ... + (b_k/B)·grad(mean_k) = grad(mean over all B): the step
equals one step on the whole batch, even when the last micro-batch is short. Dividing every
micro-batch loss by k instead over-weights a short last micro-batch.

Data-parallel, the k backward passes must not each all-reduce: only the sum matters, so the
gradients are averaged once, after the last micro-batch, over the data-parallel ``group`` (the
whole world by default). Phase 1's ``average_gradients`` is simply called once;
``DistributedDataParallel`` needs ``no_sync()`` around all but the last micro-batch
(torch/nn/parallel/distributed.py), otherwise its hooks fire every backward.

The demo (DDP, counting bucket all-reduces) is demos/accumulation.py:

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase2_advanced.demos.accumulation
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phase1_data_parallel.template_trainer import average_gradients

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MicroBatch = tuple[torch.Tensor, torch.Tensor]


def split_micro_batches(
    inputs: torch.Tensor, targets: torch.Tensor, micro_batch_size: int
) -> list[MicroBatch]:
    """Consecutive micro-batches of ``micro_batch_size`` samples; the last may be shorter."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size}: it must be at least 1")
    if len(inputs) != len(targets):
        raise ValueError(f"{len(inputs)} inputs but {len(targets)} targets")
    return list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size), strict=True))


def accumulate_gradients(
    model: nn.Module, loss_fn: LossFn, micro_batches: Sequence[MicroBatch]
) -> float:
    """Backward through every micro-batch so ``.grad`` ends as the whole batch's gradient.

    ``loss_fn`` must average over its batch (reduction="mean"). Returns the whole batch's mean
    loss. Gradients add to whatever ``.grad`` holds: zero them before the first micro-batch.
    """
    total = sum(len(targets) for _, targets in micro_batches)
    # TODO 2.1: accumulate gradients over the micro-batches, weighting each by its samples.
    # Invariant: afterwards p.grad equals the gradient of the mean loss over ALL samples,
    #   also when the last micro-batch is shorter; the return value is that mean loss; the
    #   model runs once per micro-batch, on that micro-batch only.
    # Hint 1: backward() adds into .grad. Weight each micro-batch's mean loss so that it
    #   counts for its share of the samples; dividing by the number of micro-batches is only
    #   right when all micro-batches have the same size.
    # More hints: uv run python -m tests.hint 2.1
    # See guidelines.md#21-gradient-accumulation
    raise NotImplementedError(
        "TODO 2.1: accumulate gradients over the micro-batches, weighting each by its samples "
        "(see phase2_advanced/guidelines.md#21-gradient-accumulation)"
    )


def accumulation_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    micro_batch_size: int,
    data_parallel: bool = False,
    *,
    group: dist.ProcessGroup | None = None,
) -> float:
    """One optimizer step on ``inputs`` taken in micro-batches; returns the batch's mean loss.

    With ``data_parallel=True`` (a process group is running and ``model`` is a plain module
    replicated on every rank of ``group``, the whole world when None) gradients are averaged
    across the group with phase 1's ``average_gradients``: once per optimizer step, not once
    per micro-batch.
    """
    # TODO 2.1: zero, accumulate, (average across the group once), step.
    # Invariant: exactly one gradient all-reduce per optimizer step when data_parallel, on
    #   `group` only; the update equals one step on the whole batch (on one rank, or on the
    #   concatenation of every group member's batch).
    # Hint 1: the accumulation is local work; communication belongs after the last
    #   micro-batch, when .grad holds the full local gradient.
    # More hints: uv run python -m tests.hint 2.1
    # See guidelines.md#21-gradient-accumulation
    raise NotImplementedError(
        "TODO 2.1: zero, accumulate, (average across the group once), step "
        "(see phase2_advanced/guidelines.md#21-gradient-accumulation)"
    )


def ddp_accumulation_step(
    ddp_model: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    micro_batch_size: int,
) -> float:
    """The same step with ``DistributedDataParallel``; it all-reduces in the last backward only.

    The data-parallel group is the one ``ddp_model`` was built with (``process_group=``).
    """
    micro_batches = split_micro_batches(inputs, targets, micro_batch_size)
    total = len(targets)
    optimizer.zero_grad(set_to_none=True)
    # TODO 2.1: accumulate under ddp_model.no_sync() for every micro-batch but the last.
    # Invariant: DDP all-reduces each gradient bucket once per optimizer step (during the
    #   last micro-batch's backward), and the update equals one step on the whole batch,
    #   also when the last micro-batch is shorter.
    # Hint 1: DDP all-reduces from hooks that run during backward(); inside no_sync() it only
    #   accumulates locally, and it decides in forward whether the next backward syncs. The
    #   loss weighting is the same as accumulate_gradients'.
    # More hints: uv run python -m tests.hint 2.1
    # See guidelines.md#21-gradient-accumulation
    raise NotImplementedError(
        "TODO 2.1: accumulate under ddp_model.no_sync() for every micro-batch but the last "
        "(see phase2_advanced/guidelines.md#21-gradient-accumulation)"
    )
