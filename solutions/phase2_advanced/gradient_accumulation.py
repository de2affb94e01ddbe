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

from solutions.phase1_data_parallel.trainer import average_gradients

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
    # Hint 2: one loop over the micro-batches; each pass is forward, weighted loss, backward,
    #   and adds its weighted loss (as a Python float) to a running sum that is returned.
    #   Nothing is kept from one pass to the next, so only one micro-batch's graph is alive.
    # Hint 3: a micro-batch's weight is its number of targets over the total; its weighted
    #   loss is the loss of the model's output times that weight; backward on the weighted
    #   loss, and its .item() goes into the running sum.
    # See guidelines.md#21-gradient-accumulation
    # >>> solution
    mean_loss = 0.0
    for inputs, targets in micro_batches:
        weighted = loss_fn(model(inputs), targets) * (len(targets) / total)
        weighted.backward()
        mean_loss += weighted.item()
    return mean_loss
    # <<< solution


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
    # Hint 2: What must .grad hold before the first micro-batch, and after the last? Which function
    #   above cuts the batch into micro-batches, and which one runs forward and backward over them?
    #   When has the group something worth averaging, and how many times per optimizer step may it
    #   communicate? What does the caller expect back?
    # Hint 3: Four steps in order: clear the gradients; accumulate over the micro-batches that
    #   split_micro_batches makes (the function above); when data_parallel, phase 1's
    #   average_gradients once, passing the group on; step. Return the accumulated loss.
    # See guidelines.md#21-gradient-accumulation
    # >>> solution
    optimizer.zero_grad(set_to_none=True)
    loss = accumulate_gradients(
        model, loss_fn, split_micro_batches(inputs, targets, micro_batch_size)
    )
    if data_parallel:
        average_gradients(model, group=group)
    optimizer.step()
    return loss
    # <<< solution


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
    # Hint 2: the loop of accumulate_gradients, with each micro-batch's forward AND backward
    #   inside a context that turns syncing off for all but the last micro-batch and does
    #   nothing for the last; one optimizer step after the loop.
    # Hint 3: enumerate the micro-batches; the context is the DDP model's no_sync() for
    #   every index below the last one and contextlib.nullcontext() for the last; the
    #   forward (through the DDP model) and the backward both inside the `with`.
    # See guidelines.md#21-gradient-accumulation
    # >>> solution
    mean_loss = 0.0
    last = len(micro_batches) - 1
    for index, (x, y) in enumerate(micro_batches):
        context = ddp_model.no_sync() if index < last else contextlib.nullcontext()
        with context:
            weighted = loss_fn(ddp_model(x), y) * (len(y) / total)
            weighted.backward()
        mean_loss += weighted.item()
    optimizer.step()
    return mean_loss
    # <<< solution
