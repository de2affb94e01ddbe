"""Exercise 2.1: gradient accumulation, a big batch in small pieces, one all-reduce per step.

Memory for activations grows with the batch. To train with an effective batch B when only
B/k fits, run k micro-batches forward and backward, let their gradients add up in ``.grad``, and
step once. Gradients are linear, so with each micro-batch's mean loss weighted by its share of
the samples, (b_1/B)·grad(mean_1) + ... + (b_k/B)·grad(mean_k) = grad(mean over all B): the step
equals one step on the whole batch, even when the last micro-batch is short. Dividing every
micro-batch loss by k instead over-weights a short last micro-batch.

Data-parallel, the k backward passes must not each all-reduce: only the sum matters, so the
gradients are averaged once, after the last micro-batch. Phase 1's ``average_gradients`` is
simply called once; ``DistributedDataParallel`` needs ``no_sync()`` around all but the last
micro-batch (torch/nn/parallel/distributed.py), otherwise its hooks fire every backward.

    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.gradient_accumulation
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from solutions.common.distributed import distributed_session, env_int
from solutions.common.models import BabyCNN
from solutions.common.rank_logging import log0
from solutions.common.seeding import seed_everything
from solutions.common.training import (
    LoopConfig,
    check_global_batch,
    global_batch_error,
    train_data_parallel,
)
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
    #   also when the last micro-batch is shorter; the return value is that mean loss.
    # Hint 1: backward() adds into .grad. A micro-batch with b of the total samples
    #   contributes (b / total) times its mean loss; dividing by the number of micro-batches
    #   is only right when all micro-batches have the same size.
    # Hint 2: for x, y in micro_batches: loss = loss_fn(model(x), y) * (len(y) / total);
    #   loss.backward(); mean += loss.item(). Return mean.
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
) -> float:
    """One optimizer step on ``inputs`` taken in micro-batches; returns the batch's mean loss.

    With ``data_parallel=True`` (a process group is running and ``model`` is a plain module
    replicated on every rank) gradients are averaged across ranks with phase 1's
    ``average_gradients``: once per optimizer step, not once per micro-batch.
    """
    # TODO 2.1: zero, accumulate, (average across ranks once), step.
    # Invariant: exactly one gradient all-reduce per optimizer step when data_parallel, and
    #   the update equals one step on the whole batch (on one rank or on all ranks' batches).
    # Hint 1: the accumulation is local work; communication belongs after the last
    #   micro-batch, when .grad holds the full local gradient.
    # Hint 2: optimizer.zero_grad(set_to_none=True); loss = accumulate_gradients(model,
    #   loss_fn, split_micro_batches(inputs, targets, micro_batch_size)); if data_parallel:
    #   average_gradients(model); optimizer.step(); return loss.
    # See guidelines.md#21-gradient-accumulation
    # >>> solution
    optimizer.zero_grad(set_to_none=True)
    loss = accumulate_gradients(
        model, loss_fn, split_micro_batches(inputs, targets, micro_batch_size)
    )
    if data_parallel:
        average_gradients(model)
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
    """The same step with ``DistributedDataParallel``; it all-reduces in the last backward only."""
    micro_batches = split_micro_batches(inputs, targets, micro_batch_size)
    total = len(targets)
    optimizer.zero_grad(set_to_none=True)
    # TODO 2.1: accumulate under ddp_model.no_sync() for every micro-batch but the last.
    # Invariant: DDP all-reduces each gradient bucket once per optimizer step (during the
    #   last micro-batch's backward), and the update equals one step on the whole batch.
    # Hint 1: DDP all-reduces from hooks that run during backward(); inside no_sync() it only
    #   accumulates locally. The loss weighting is the same as accumulate_gradients'.
    # Hint 2: for i, (x, y) in enumerate(micro_batches): context = ddp_model.no_sync() if
    #   i < len(micro_batches) - 1 else contextlib.nullcontext(); with context:
    #   (loss_fn(ddp_model(x), y) * len(y) / total).backward(). Then optimizer.step().
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


class AllReduceCount:
    """How many bucket all-reduces DDP launched: the state of :func:`counting_allreduce_hook`."""

    def __init__(self) -> None:
        self.calls = 0


def counting_allreduce_hook(
    state: AllReduceCount, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: count the call, then do PyTorch's default all-reduce.

    Register with ``ddp_model.register_comm_hook(AllReduceCount(), counting_allreduce_hook)``
    (default hook: torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py).
    """
    state.calls += 1
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


# DDP checks a hook's annotations against the real classes; `from __future__ import annotations`
# turned them into strings, so give them back as objects.
counting_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="data-parallel training with accumulation")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--train-samples", type=int, default=4096)
    args = parser.parse_args(argv)
    if (error := global_batch_error(args.global_batch_size)) is not None:
        return error
    per_rank = check_global_batch(args.global_batch_size, env_int("WORLD_SIZE", 1))
    with distributed_session() as info:
        seed_everything(0)
        counter = AllReduceCount()
        steps = 0

        def step(
            model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
        ) -> float:
            nonlocal steps
            steps += 1
            assert isinstance(model, DistributedDataParallel)
            return ddp_accumulation_step(
                model, optimizer, nn.functional.cross_entropy, x, y, args.micro_batch_size
            )

        micro = -(-per_rank // args.micro_batch_size)
        log0(
            f"accumulation: world {info.world_size}, global batch {args.global_batch_size} = "
            f"{info.world_size} ranks x {micro} micro-batches of <= {args.micro_batch_size}"
        )
        config = LoopConfig(
            epochs=args.epochs,
            global_batch_size=args.global_batch_size,
            lr=args.lr,
            train_samples=args.train_samples,
        )
        model = BabyCNN().to(info.device)
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(counter, counting_allreduce_hook)
        train_data_parallel(ddp, step, config, info, wrap_ddp=False)
        log0(
            f"DDP bucket all-reduces: {counter.calls} over {steps} optimizer steps "
            f"({counter.calls / max(steps, 1):.1f} per step; {micro} micro-batches per step)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
