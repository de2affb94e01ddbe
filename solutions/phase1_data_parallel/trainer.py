"""Exercises 1.2 and 1.4: synchronous data-parallel training, built by hand.

Every rank holds a full copy of the model and trains on its own B/N samples of every batch; the
ranks average their gradients, so every rank applies the same update and the copies never drift
apart. This is what ``DistributedDataParallel`` does (Li et al., "PyTorch Distributed", VLDB
2020), minus its bucketing and overlap (phase 3).

Every function takes ``group=`` (None: the default group) and ranks within it, so the same code
trains inside a data-parallel subgroup. The epoch loop is the course's one loop
(``course/training.py``); the settings, model and report are given (``trainer_support.py``).

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase1_data_parallel.trainer
"""

from __future__ import annotations

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
    """Make every rank's model state (its ``state_dict()``) equal to rank ``src``'s, in place.

    ``src`` is a rank within ``group`` (None: the default group, where group and global ranks
    are the same). Seeding alone is not enough: a different library version, device or
    initialisation order on one rank would silently train N different models.
    """
    # TODO 1.2: make every rank's model state equal to rank src's, in place.
    # Invariant: afterwards every rank of `group` holds a state_dict() bitwise equal to rank
    #   src's, in the same tensor objects as before (an optimizer holds references to them);
    #   no rank outside `group` takes part.
    # Hint 1: what does a model's state_dict() hold that its parameters() do not yield?
    # Hint 2: Which tensors does state_dict() hold besides the parameters? Which collective
    #   leaves one rank's tensor on every rank, and does it write into the very tensor you hand
    #   it or return a new one? `src` is a rank of the group: which of torch's arguments takes
    #   a rank of the group, and which a global rank?
    # Hint 3: The buffers. A model's buffers() (a BatchNorm's running statistics, the test's
    #   `scale`) are state too, and every rank walks them in the same order as its peers.
    # Hint 4: dist.broadcast writes into the tensor it is handed, so hand it each parameter and
    #   buffer itself, never a copy. Its src argument is a global rank; its group_src argument
    #   is a rank of the group, the kind `src` is here.
    # Hint 5: The answer in words: with autograd off (torch.no_grad), for every parameter and
    #   then every buffer of the model, one dist.broadcast of that tensor on the group, with the
    #   root given as a group rank (group_src).
    # See guidelines.md#12-broadcast-and-gradient-averaging
    # >>> solution
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
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
    # TODO 1.2: make every existing gradient the mean of that gradient over the group's ranks.
    # Invariant: afterwards each existing p.grad holds the mean over the ranks of `group`, the
    #   same on every one of them; gradients leave the rank through all_reduce alone, in as few
    #   calls as their dtypes allow, each in its own dtype; the returned int is the bytes
    #   handed to all_reduce.
    # Hint 1: what does an all-reduce leave in the tensor it is handed, and what does each
    #   call cost (the guide's cost model)?
    # Hint 2: An all-reduce sums: what turns the sum into a mean, and which count is that
    #   inside the group (2, 3) of a world of 4? Each call costs one latency: how many
    #   gradients can one call carry, and what must they have in common? How do the averaged
    #   values get back into each .grad?
    # Hint 3: The divisor is the size of the group (dist.get_world_size given the group), not
    #   the world's: 2 in the group (2, 3) of a world of 4, whose world size is 4.
    # Hint 4: One call per dtype. The gradients of one dtype, each flattened, concatenated into
    #   one buffer: two float64 gradients of 6 and 4 elements make one buffer of 10 elements,
    #   80 bytes. After the sum and the division, its first 6 elements go back into the first
    #   gradient and the next 4 into the second, each viewed as its gradient's shape.
    # Hint 5: The answer in words: group the existing gradients by dtype; for each dtype,
    #   concatenate them flattened into one buffer (torch.cat), all_reduce it on the group,
    #   divide it in place by the group's size, and copy consecutive slices of it back into
    #   each gradient in the same order; return the sum over the buffers of their element
    #   count times their element size.
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
    """One synchronous data-parallel step on this rank's batch, among the ranks of ``group``.

    Returns this rank's loss and the step's time in two parts, computing and communicating. The
    communication time includes waiting for the slowest rank: a straggler shows up here.
    """
    # TODO 1.2: one data-parallel step on this rank's batch, its time split in two parts.
    # Invariant: afterwards every rank of `group` holds the weights one process would hold
    #   after one step on the union of their batches; compute_seconds + communication_seconds
    #   is the whole step, communication_seconds the averaging alone; each part times work
    #   that has finished, on a GPU too.
    # Hint 1: a single-process training step, with average_gradients (above) somewhere in it.
    # Hint 2: Where does the averaging go among clearing the gradients, forward, backward and
    #   the optimizer's step? Backward adds into .grad: when must the previous step's
    #   gradients go? How many clock readings split the step into the averaging and the rest?
    #   On a GPU a call returns once its kernels are queued: what must come before a reading?
    # Hint 3: The averaging goes between backward and the optimizer's step: the optimizer must
    #   apply the mean. The previous step's gradients are cleared before backward, to None
    #   (the optimizer's zero_grad does it), so a parameter without a gradient stays without.
    # Hint 4: Four readings of time.perf_counter: at the start, after backward, after the
    #   averaging, after the optimizer's step. Communication is the middle interval; compute
    #   is the first and the last added together. Before every reading but the first,
    #   synchronize on the device the inputs are on.
    # Hint 5: The answer in words: clear the gradients, read the clock, forward and the loss
    #   on this rank's batch, backward, synchronize and read, average_gradients with the given
    #   all-reduce and group, synchronize and read, the optimizer's step, synchronize and read;
    #   return a StepStats of the loss as a Python float, the two parts, and the bytes
    #   average_gradients returned.
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
    # TODO 1.4: refuse a run whose global batch or all-reduce cannot work, naming the fix.
    # Invariant: a bad run fails here with a ValueError, before any process group, data or model
    #   exists; the message quotes the value given and says what would work.
    # Hint 1: 1.2's argument that a mean of the ranks' means is the whole batch's mean: which
    #   batches does it need?
    # Hint 2: Which global batch sizes can every rank share equally, and is one smaller than
    #   the world among them (some ranks would get nothing)? What does a person need from the
    #   message to fix the command: the flag, the value given, a value that works? Where are
    #   the valid strategy names kept?
    # Hint 3: The batch: every rank gets the same number of samples only when the world size
    #   divides the global batch; 63 on 2 ranks leaves a remainder of 1, and 64 or 62 would work.
    # Hint 4: The message names the flag (--global-batch-size), the value, "use a multiple of N"
    #   and a size that works; for the strategy, the name quoted and the keys of
    #   ALL_REDUCE_STRATEGIES listed.
    # Hint 5: The answer in words: two checks, each raising ValueError: a global batch smaller
    #   than the world size or leaving a remainder when divided by it, with the message of
    #   Hint 4; then an all-reduce name that is not a key of ALL_REDUCE_STRATEGIES, quoted, with
    #   the keys listed.
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
        # Invariant: every epoch reshuffles (epoch e's order depends on e), the same on every
        #   rank, and a resumed epoch skips the first start_index samples of this rank's shard.
        # Hint 1: which object of the loop yields the epoch's indices (your 1.1)?
        # Hint 2: Which object decides the order of the samples, and what must it be told before
        #   each epoch to change that order, and to skip what a resumed run already trained? What
        #   does it do if nobody tells it anything?
        # Hint 3: The sampler (self.sampler, your 1.1) decides, and its set_epoch is how it
        #   learns the epoch: untold, it deals epoch 0's order every epoch.
        # Hint 4: start_index goes to the sampler too, in the same call: after a crash at sample
        #   12 of this rank's shard, start_epoch of that epoch with start_index 12.
        # Hint 5: The answer in words: one call of the sampler's set_epoch with this epoch,
        #   start_index passed on as its keyword argument.
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
        # Invariant: each rank steps on its own batch among the ranks of the loop's group, with
        #   the loop's all-reduce; `loss` is the batch's mean loss and `samples` its size, so
        #   the loop's sum of loss x samples over the epoch is exact; bytes_sent is what this
        #   rank passed to send/isend during the step.
        # Hint 1: which of your 1.2 functions is one step, and what does it return?
        # Hint 2: Which group and which all-reduce does the step use, and where does the loop
        #   keep them? `loss` is a mean over what, and `samples` counts what? The all-reduce is a
        #   function you were handed: how does the step learn the bytes this rank passed to
        #   send/isend while it ran?
        # Hint 3: data_parallel_step does the step, with the loop's model, optimizer and loss
        #   function, the batch, and the group and all-reduce the loop keeps (self.group,
        #   self.all_reduce_fn); its StepStats gives the loss, the two times and bytes_reduced.
        # Hint 4: A CommCounter (given) around the step counts what this rank sends: on 4 ranks
        #   with direct exchange and S bytes of gradients, 3 S a step, while bytes_reduced is S.
        # Hint 5: The answer in words: inside a with CommCounter block, data_parallel_step on
        #   the loop's pieces and the batch; return a StepOutput of the step's loss, the number
        #   of targets as samples, and metrics holding the two times, bytes_reduced and the
        #   counter's bytes_sent read after the block, each as a float.
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
        # TODO 1.4: sum each of this rank's epoch totals over all ranks of the loop's group.
        # Invariant: every rank returns the same dict, with the same keys, whose values are the
        #   exact sums over the group (so rank 0 can print them, and any rank could).
        # Hint 1: what does each collective cost, and how many values can one carry?
        # Hint 2: How many collectives for the whole dict, and over which group? How do the
        #   ranks agree on which value is which, when each rank's dict was filled in its own
        #   order? In which dtype do counts beyond 2^24 stay exact?
        # Hint 3: One all-reduce of one tensor holding every value, on the loop's group
        #   (self.group), on the loop's device.
        # Hint 4: The keys in sorted order on every rank, so position i is the same key
        #   everywhere; the tensor in float64: 2^24 + 1 samples on each of 2 ranks sum to
        #   2^25 + 2 in float64 and to 2^25 in float32.
        # Hint 5: The answer in words: the sorted keys; their values in that order in one
        #   float64 tensor on the loop's device; dist.all_reduce of it on the loop's group; the
        #   sorted keys paired with the summed values, as Python floats, in a new dict.
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
