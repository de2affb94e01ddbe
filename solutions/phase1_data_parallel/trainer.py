"""Exercises 1.2 and 1.4: synchronous data-parallel training, built by hand.

Every rank holds a full copy of the model. Each step, each rank runs forward and backward on its
own B/N samples, then the ranks average their gradients, so every rank applies the same update
and the copies never drift apart: with equal shards, the mean of the N local mean-gradients is
the gradient of the mean loss over all B samples. This is what ``DistributedDataParallel`` does
(Li et al., "PyTorch Distributed", VLDB 2020), minus its bucketing and overlap (phase 3).

Every function takes ``group=`` (None: the default group) and ranks within it, so the same code
trains inside a data-parallel subgroup. The epoch loop is the course's one loop
(``course/training.py``); the settings, model and report are given (``trainer_support.py``).

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase1_data_parallel.trainer
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from course.cli import parse_config, refuse_before_start, run_main
from course.comm_counter import CommCounter
from course.distributed import current_info, distributed_session
from course.rank_logging import log0
from course.seeding import seed_everything
from course.training import Callback, StepOutput, TrainingLoop, evaluate
from phase1_data_parallel.trainer_support import (
    StepStats,
    TrainConfig,
    TrainResult,
    build_model,
    check_given_settings,
    epoch_line,
    epoch_stats,
    pattern_datasets,
    record_run,
    start_line,
    synchronize,
)
from solutions.phase1_data_parallel.all_reduce import (
    direct_exchange_all_reduce,
    reduce_broadcast_all_reduce,
)
from solutions.phase1_data_parallel.data_loader import DistributedShardSampler

AllReduceFn = Callable[..., Any]  # (tensor, *, group=None) -> Any; sums in place

ALL_REDUCE_STRATEGIES: dict[str, AllReduceFn] = {
    "torch": dist.all_reduce,
    "reduce_broadcast": reduce_broadcast_all_reduce,
    "direct_exchange": direct_exchange_all_reduce,
}


# ----------------------------------------------------------------------------- exercise 1.2


def broadcast_parameters(
    model: nn.Module, src: int = 0, *, group: dist.ProcessGroup | None = None
) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s, in place.

    ``src`` is a rank within ``group`` (None: the default group, where group and global ranks
    are the same). Seeding alone is not enough: a different library version, device or
    initialisation order on one rank would silently train N different models.
    """
    # TODO 1.2: copy rank src's parameters AND buffers to every other rank, in place.
    # Invariant: afterwards all ranks of `group` hold bitwise-identical model state; the tensors
    #   themselves are updated (the optimizer keeps references to them); no rank outside
    #   `group` is involved.
    # Hint 1: buffers (e.g. BatchNorm running stats) are model state too; which collective
    #   makes every rank's tensor equal to one rank's?
    # Hint 2: walk parameters and buffers together and broadcast each tensor itself (not a
    #   copy), without recording autograd. `src` counts within the group, while torch's root
    #   argument of broadcast is a global rank unless you name it as a group rank.
    # Hint 3: under torch.no_grad(), for each tensor of itertools.chain(parameters, buffers):
    #   dist.broadcast with group=group and group_src=src.
    # See guidelines.md#12-broadcast-and-gradient-averaging
    # >>> solution
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(tensor, group=group, group_src=src)
    # <<< solution


def average_gradients(
    model: nn.Module,
    all_reduce_fn: AllReduceFn | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Replace every ``.grad`` with its mean over ``group``'s ranks; return the bytes reduced.

    ``all_reduce_fn(tensor, group=group)`` sums in place (default ``dist.all_reduce``). Parameters
    without a gradient (frozen, or unused in this forward) are skipped; every rank must agree on
    which those are.
    """
    all_reduce = all_reduce_fn or dist.all_reduce
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0
    # TODO 1.2: average the gradients across the group's ranks, in place, with all_reduce.
    # Invariant: afterwards every rank's p.grad is the mean over the group (sum / group size),
    #   identical on all its ranks; the returned int is the bytes passed to all_reduce.
    # Hint 1: an all-reduce sums, and a mean needs one more operation. One call on one flat
    #   buffer costs one message latency instead of one per tensor; a model may mix dtypes.
    # Hint 2: per dtype: concatenate the flattened gradients, all-reduce that buffer once on
    #   the group, divide by the group's size, then copy consecutive slices back into each
    #   .grad (same order, reshaped). The byte count is the buffers' element count times the
    #   element size.
    # Hint 3: a dict from dtype to the list of gradients of that dtype; per list, torch.cat
    #   of each gradient reshaped to one dimension is the flat buffer; all_reduce it on
    #   `group`, divide it in place by the group's world size, and copy the slice
    #   [offset, offset + numel) back into each gradient, viewed as its shape.
    # See guidelines.md#12-broadcast-and-gradient-averaging
    # >>> solution
    world = dist.get_world_size(group)
    total_bytes = 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        flat = torch.cat([grad.reshape(-1) for grad in same_dtype])
        all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for grad in same_dtype:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        total_bytes += flat.numel() * flat.element_size()
    return total_bytes
    # <<< solution


def data_parallel_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    all_reduce_fn: AllReduceFn | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> StepStats:
    """One synchronous step on this rank's batch: forward, backward, average gradients over
    ``group``, update.

    Returns this rank's loss and the time spent computing vs communicating. The communication
    time includes waiting for the slowest rank: a straggler shows up here.
    """
    # TODO 1.2: one data-parallel step, timed in two parts.
    # Invariant: after the step, all ranks of `group` hold identical weights equal to one
    #   process stepping on the union of their batches; gradients from the last step never
    #   leak in; compute_seconds + communication_seconds is the whole step, and only the
    #   averaging counts as communication.
    # Hint 1: a local training step with one extra piece between backward and the optimizer:
    #   average_gradients, above. Only that piece is communication. On a GPU the clock must
    #   wait for queued kernels (synchronize, given).
    # Hint 2: read the clock four times: at the start, after backward, after averaging and
    #   after the optimizer step. Communication is the one interval around averaging; compute
    #   is the two intervals around it added together (the optimizer step is compute). Clear
    #   the old gradients first (to None, so "no gradient" stays distinguishable). Return the
    #   loss as a Python float and the byte count average_gradients gave back.
    # Hint 3: the optimizer's zero_grad with set_to_none; the loss of the model's output on
    #   the targets, then its backward; synchronize on the inputs' device right before each
    #   time.perf_counter; average_gradients with the given all-reduce and group; the
    #   optimizer's step. compute = (t1 - t0) + (t3 - t2), communication = t2 - t1.
    # See guidelines.md#12-broadcast-and-gradient-averaging
    # >>> solution
    device = inputs.device
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    synchronize(device)
    backward_done = time.perf_counter()
    nbytes = average_gradients(model, all_reduce_fn, group=group)
    synchronize(device)
    averaged = time.perf_counter()
    optimizer.step()
    synchronize(device)
    stepped = time.perf_counter()
    return StepStats(
        loss=loss.item(),
        compute_seconds=(backward_done - start) + (stepped - averaged),
        communication_seconds=averaged - backward_done,
        bytes_reduced=nbytes,
    )
    # <<< solution


# ----------------------------------------------------------------------------- exercise 1.4


def validate_config(config: TrainConfig, world_size: int) -> None:
    """Refuse a run that cannot work, before any process group or data exists."""
    # TODO 1.4: refuse a global batch the world cannot split evenly, and an unknown strategy.
    # Invariant: a bad run fails here, before any process group, data or model exists, with a
    #   message that names the bad value and the fix.
    # Hint 1: unequal per-rank batches break the "mean of means = global mean" argument and
    #   give ranks different step counts; ALL_REDUCE_STRATEGIES lists the valid names.
    # Hint 2: Which global batch sizes can every rank share equally, and what about one smaller than
    #   the world (some ranks would get nothing)? What does a person need from the message to fix
    #   the command: the flag, the value given, a value that works? Where are the valid strategy
    #   names kept?
    # Hint 3: Two checks, each raising ValueError. The batch: refuse a remainder when divided by
    #   world_size, and a batch smaller than the world; say which flag, the value, and "use a
    #   multiple of N" with a size that works. The strategy: refuse a name that is not a key of
    #   ALL_REDUCE_STRATEGIES, quoting it and listing the keys.
    # See guidelines.md#14-the-data-parallel-trainer
    # >>> solution
    if config.global_batch_size < world_size or config.global_batch_size % world_size:
        lower = max(world_size, config.global_batch_size // world_size * world_size)
        raise ValueError(
            f"--global-batch-size {config.global_batch_size} is not divisible by the world "
            f"size {world_size}: every rank must get the same number of samples per step; "
            f"use a multiple of {world_size}, e.g. {lower}"
        )
    if config.all_reduce not in ALL_REDUCE_STRATEGIES:
        raise ValueError(
            f"--all-reduce {config.all_reduce!r} is unknown: choose one of "
            f"{', '.join(ALL_REDUCE_STRATEGIES)}"
        )
    # <<< solution
    check_given_settings(config, world_size)


class DataParallelLoop(TrainingLoop):
    """The course's training loop (course/training.py) with phase 1's parts.

    The loop is given: it moves each batch to ``device``, adds up what every step returns, and
    calls callbacks. This class says how an epoch starts (:meth:`start_epoch`), what one step
    on this rank does (:meth:`train_step`) and how the ranks of ``group`` agree on the epoch's
    totals (:meth:`reduce_totals`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: DataLoader,
        sampler: DistributedShardSampler,
        *,
        device: torch.device,
        all_reduce_fn: AllReduceFn | None = None,
        group: dist.ProcessGroup | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        super().__init__(
            model,
            optimizer,
            loader,
            device=device,
            sampler=sampler,
            group=group,
            loss_fn=nn.functional.cross_entropy,
            callbacks=callbacks,
        )
        self.all_reduce_fn = all_reduce_fn

    def start_epoch(self, epoch: int, start_index: int = 0) -> None:
        """Called by the loop on every rank before the epoch's first batch is drawn."""
        # TODO 1.4: give this epoch its own order of samples, the same on every rank.
        # Invariant: every epoch reshuffles (epoch e's order depends on e) and a resumed run
        #   skips the first start_index samples of this rank's shard.
        # Hint 1: the sampler shuffles with seed + epoch; it only learns the epoch from you.
        # Hint 2: Which object decides the order of the samples, and what must it be told to change
        #   that order each epoch, and to skip what a resumed run already trained? Forgetting this
        #   still trains (every epoch on epoch 0's order), so the grader records each epoch's order.
        # Hint 3: One call of the sampler's set_epoch, with this epoch and with start_index passed
        #   on as its keyword argument.
        # See guidelines.md#14-the-data-parallel-trainer
        # >>> solution
        self.sampler.set_epoch(epoch, start_index=start_index)
        # <<< solution

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        """One data-parallel step on this rank's batch; returns its loss and what it cost.

        ``metrics`` keys: compute_seconds, communication_seconds, bytes_reduced (the payload
        handed to the all-reduce) and bytes_sent (what this rank passed to send/isend).
        """
        # TODO 1.4: run one data-parallel step on this rank's batch and report what it cost.
        # Invariant: each rank steps on its own batch, averaging over `group` with the chosen
        #   all-reduce; `loss` is the batch's mean loss and `samples` its size, so the loop's
        #   sum loss x samples over the epoch is exact.
        # Hint 1: data_parallel_step (1.2) does the work; CommCounter (a context manager)
        #   counts what this rank sends while it is active.
        # Hint 2: run the step with the loop's model, optimizer, loss function, all-reduce and
        #   group while the counter is active; build a StepOutput from the StepStats it
        #   returns: its loss, the number of targets, and the four metrics named in the
        #   docstring, the last one read from the counter afterwards.
        # Hint 3: data_parallel_step takes the loop's model, optimizer and loss function, the
        #   batch, the loop's all-reduce function and its group (a keyword); run it inside
        #   `with CommCounter()`; bytes_sent is the counter's, read after the block; the
        #   metrics are floats.
        # See guidelines.md#14-the-data-parallel-trainer
        # >>> solution
        with CommCounter() as comm:
            stats = data_parallel_step(
                self.model,
                self.optimizer,
                self.loss_fn,
                inputs,
                targets,
                self.all_reduce_fn,
                group=self.group,
            )
        return StepOutput(
            loss=stats.loss,
            samples=targets.shape[0],
            metrics={
                "compute_seconds": stats.compute_seconds,
                "communication_seconds": stats.communication_seconds,
                "bytes_reduced": float(stats.bytes_reduced),
                "bytes_sent": float(comm.bytes_sent),
            },
        )
        # <<< solution

    def reduce_totals(self, totals: dict[str, float]) -> dict[str, float]:
        """This rank's sums for the epoch -> the sums over every rank of the group."""
        # TODO 1.4: sum each of this rank's epoch totals over all ranks of the group.
        # Invariant: every rank returns the same dict, with the same keys, whose values are the
        #   sums over the group (so rank 0 can print them, and any rank could).
        # Hint 1: one all-reduce of all the values at once, not one per key; every rank must
        #   put the keys in the same order.
        # Hint 2: order the keys the same way on every rank, pack the values into one tensor
        #   (in a dtype that keeps large sums exact) on the loop's device, all-reduce it over
        #   the loop's group, and pair the keys with the summed values again.
        # Hint 3: the keys in sorted order; their values in one float64 tensor on the loop's
        #   device; dist.all_reduce of it on the loop's group; zip the sorted keys with the
        #   summed values (as a Python list) back into a dict.
        # See guidelines.md#14-the-data-parallel-trainer
        # >>> solution
        keys = sorted(totals)
        values = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(values, group=self.group)
        return dict(zip(keys, values.tolist(), strict=True))
        # <<< solution


def train(config: TrainConfig, *, group: dist.ProcessGroup | None = None) -> TrainResult:
    """Train inside an existing process group (torchrun's, or a test world's).

    With ``group``, only its ranks train together (they split the data between them; other
    groups may train their own copy at the same time).
    """
    info = current_info()
    world = dist.get_world_size(group)
    validate_config(config, world)
    seed_everything(config.seed)
    model = build_model(config).to(info.device)
    broadcast_parameters(model, src=0, group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    train_set, test_set = pattern_datasets(config)
    sampler = DistributedShardSampler(train_set, shuffle=True, seed=config.seed, group=group)
    loader = DataLoader(train_set, batch_size=config.global_batch_size // world, sampler=sampler)
    loop = DataParallelLoop(
        model,
        optimizer,
        loader,
        sampler,
        device=info.device,
        all_reduce_fn=ALL_REDUCE_STRATEGIES[config.all_reduce],
        group=group,
    )
    result = TrainResult(config=config)
    log0(start_line(config, world, info))
    for epoch in range(config.epochs):
        totals = loop.run_epoch(epoch)
        accuracy = evaluate(model, test_set, info.device, group=group)
        result.epochs.append(epoch_stats(totals, accuracy, world))
        log0(epoch_line(result.epochs[-1], config))
    result.model = model
    return result


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(TrainConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate_config(config, world))) is not None:
        return code
    with distributed_session():
        record_run(config, train(config))
    return 0


if __name__ == "__main__":
    run_main(main)
