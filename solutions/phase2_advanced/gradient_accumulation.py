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
    # Hint 2: Write the batch's mean loss as a weighted sum of the micro-batches' means: which
    #   weight does micro-batch i get? For 10 samples in 4 + 4 + 2, what does 1/k give one sample of
    #   the last micro-batch? What is kept from one micro-batch to the next, and what must not be
    #   (the graph)? What is returned, and is it the mean of the means?
    # Hint 3: Micro-batch i's weight is its number of samples over the total: 0.4, 0.4 and 0.2 for 4
    #   + 4 + 2, so that every sample weighs 1/10; with 1/k the last two samples would weigh 1/6
    #   each and the others 1/12.
    # Hint 4: One forward and one backward per micro-batch, on the weighted mean loss; the weighted
    #   losses, as Python floats, add up to the batch's mean loss, which is returned.
    # Hint 5: For each micro-batch, loss_fn of the model's output and its targets, times its
    #   targets' count over the total; backward of that; its item added to a running sum that is
    #   returned after the loop.
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
    across the group with phase 1's ``average_gradients``, with one all-reduce per optimizer
    step.
    """
    # TODO 2.1: one optimizer step on the whole batch, taken in micro-batches.
    # Invariant: the update equals one step on the whole batch (on one rank, or on the concatenation
    #   of every group member's batch); exactly one gradient all-reduce per optimizer step when
    #   data_parallel, on `group` only; returns the batch's mean loss.
    # Hint 1: the functions above cut the batch and accumulate its gradient. What must .grad hold
    #   before the first micro-batch, and when does the group have something worth averaging?
    # Hint 2: What does .grad hold when the step starts (think of the previous step)? Which function
    #   above cuts the batch into micro-batches, and which one runs forward and backward over them?
    #   After which micro-batch is the rank's gradient complete, and how many times per optimizer
    #   step may the group communicate? On which group? What does the caller expect back?
    # Hint 3: Clear the gradients once, before the first micro-batch: the previous step's are still
    #   there, and backward only adds.
    # Hint 4: When data_parallel, phase 1's average_gradients once, after the accumulation, with
    #   group passed on: one all-reduce for the step, on the group.
    # Hint 5: zero_grad; accumulate_gradients over split_micro_batches of the inputs and targets;
    #   average_gradients with the group when data_parallel; the optimizer's step; return the
    #   accumulated loss.
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
    # Hint 2: Which micro-batches must not synchronise, and which one must? DDP decides in forward
    #   whether the next backward synchronises: which part of a micro-batch, forward, backward or
    #   both, must sit inside no_sync()? What context does the last micro-batch run in? Is the
    #   weighting any different from accumulate_gradients'?
    # Hint 3: Every micro-batch but the last runs inside no_sync(); the last runs outside it, and
    #   its backward all-reduces each bucket on the accumulated sum.
    # Hint 4: The forward AND the backward of a micro-batch both go inside the context: a forward
    #   outside no_sync() with its backward inside still synchronises. The weights are b_i over B
    #   again.
    # Hint 5: Enumerate the micro-batches; the context is ddp_model.no_sync() below the last index
    #   and a context that does nothing (contextlib.nullcontext) for the last; inside it the forward
    #   through the DDP model, the weighted loss and its backward; the weighted losses summed; one
    #   optimizer step after the loop.
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
