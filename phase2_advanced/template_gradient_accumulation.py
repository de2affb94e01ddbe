# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase2.py
"""Exercise 2.1: gradient accumulation, a big batch in small pieces, one all-reduce per step.

Memory for activations grows with the batch. To train with an effective batch B when only
B/k fits, run k micro-batches forward and backward, let their gradients add up in ``.grad``, and
step once. Gradients are linear, so a weighted sum of the micro-batches' mean losses has the
same weighted sum of their gradients as its gradient: the step can equal one step on the whole
batch, even when the last micro-batch is short.

Data-parallel, only the accumulated sum needs averaging over the data-parallel ``group`` (the
whole world by default): one all-reduce per optimizer step, through phase 1's
``average_gradients``, or through ``DistributedDataParallel``, whose ``no_sync()`` context turns
its all-reduces off (torch/nn/parallel/distributed.py).

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
    """Backward through every micro-batch so that ``.grad`` gains the whole batch's gradient.

    ``loss_fn`` must average over its batch (reduction="mean"). Returns the whole batch's mean
    loss. Gradients add to whatever ``.grad`` holds.
    """
    total = sum(len(targets) for _, targets in micro_batches)
    # TODO 2.1: add the whole batch's gradient into .grad, one micro-batch at a time.
    # Invariant: afterwards p.grad has gained the gradient of the mean loss over ALL samples, also
    #   when the last micro-batch is shorter; the return value is that mean loss; the model runs
    #   once per micro-batch, on that micro-batch only.
    # Hint 1: backward() adds into .grad, and loss_fn returns each micro-batch's MEAN loss. How much
    #   should one sample of a short micro-batch count, compared with one of a full micro-batch?
    # More hints: uv run python -m tests.hint 2.1
    # See guidelines.md#21-gradient-accumulation
    raise NotImplementedError(
        "TODO 2.1: add the whole batch's gradient into .grad, one micro-batch at a time "
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
    across the group with phase 1's ``average_gradients``, with one all-reduce per optimizer
    step.
    """
    # TODO 2.1: one optimizer step on the whole batch, taken in micro-batches.
    # Invariant: the update equals one step on the whole batch (on one rank, or on the concatenation
    #   of every group member's batch); exactly one gradient all-reduce per optimizer step when
    #   data_parallel, on `group` only; returns the batch's mean loss.
    # Hint 1: the functions above cut the batch and accumulate its gradient. What must .grad hold
    #   before the first micro-batch, and when does the group have something worth averaging?
    # More hints: uv run python -m tests.hint 2.1
    # See guidelines.md#21-gradient-accumulation
    raise NotImplementedError(
        "TODO 2.1: one optimizer step on the whole batch, taken in micro-batches "
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
    """The same step with ``DistributedDataParallel``, one all-reduce per bucket per step.

    The data-parallel group is the one ``ddp_model`` was built with (``process_group=``).
    """
    micro_batches = split_micro_batches(inputs, targets, micro_batch_size)
    total = len(targets)
    optimizer.zero_grad(set_to_none=True)
    # TODO 2.1: the same step under DDP, with one all-reduce per bucket per optimizer step.
    # Invariant: DDP all-reduces each gradient bucket exactly once per optimizer step, and the
    #   update equals one step on the concatenation of every rank's batch, also when the last
    #   micro-batch is shorter.
    # Hint 1: DDP all-reduces from hooks that run during backward(), in every backward it is allowed
    #   to. Which backward of the step has the whole sum of the micro-batches' gradients?
    # More hints: uv run python -m tests.hint 2.1
    # See guidelines.md#21-gradient-accumulation
    raise NotImplementedError(
        "TODO 2.1: the same step under DDP, with one all-reduce per bucket per optimizer step "
        "(see phase2_advanced/guidelines.md#21-gradient-accumulation)"
    )
