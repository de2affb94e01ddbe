# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase1.py
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
from phase1_data_parallel.template_all_reduce import (
    direct_exchange_all_reduce,
    reduce_broadcast_all_reduce,
)
from phase1_data_parallel.template_data_loader import DistributedShardSampler

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
    # More hints: uv run python -m tests.hint 1.2
    # See guidelines.md#12-broadcast-and-gradient-averaging
    raise NotImplementedError(
        "TODO 1.2: make every rank's model state equal to rank src's, in place "
        "(see phase1_data_parallel/guidelines.md#12-broadcast-and-gradient-averaging)"
    )


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
    # More hints: uv run python -m tests.hint 1.2
    # See guidelines.md#12-broadcast-and-gradient-averaging
    raise NotImplementedError(
        "TODO 1.2: make every existing gradient the mean of that gradient over the group's ranks "
        "(see phase1_data_parallel/guidelines.md#12-broadcast-and-gradient-averaging)"
    )


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
    # More hints: uv run python -m tests.hint 1.2
    # See guidelines.md#12-broadcast-and-gradient-averaging
    raise NotImplementedError(
        "TODO 1.2: one data-parallel step on this rank's batch, its time split in two parts "
        "(see phase1_data_parallel/guidelines.md#12-broadcast-and-gradient-averaging)"
    )


# ----------------------------------------------------------------------------- exercise 1.4


def validate_config(config: TrainConfig, world_size: int) -> None:
    """Refuse a run that cannot work, before any process group or data exists."""
    # TODO 1.4: refuse a run whose global batch or all-reduce cannot work, naming the fix.
    # Invariant: a bad run fails here with a ValueError, before any process group, data or model
    #   exists; the message quotes the value given and says what would work.
    # Hint 1: 1.2's argument that a mean of the ranks' means is the whole batch's mean: which
    #   batches does it need?
    # More hints: uv run python -m tests.hint 1.4
    # See guidelines.md#14-the-data-parallel-trainer
    raise NotImplementedError(
        "TODO 1.4: refuse a run whose global batch or all-reduce cannot work, naming the fix "
        "(see phase1_data_parallel/guidelines.md#14-the-data-parallel-trainer)"
    )
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
        # More hints: uv run python -m tests.hint 1.4
        # See guidelines.md#14-the-data-parallel-trainer
        raise NotImplementedError(
            "TODO 1.4: give this epoch its own order of samples, the same on every rank "
            "(see phase1_data_parallel/guidelines.md#14-the-data-parallel-trainer)"
        )

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
        # More hints: uv run python -m tests.hint 1.4
        # See guidelines.md#14-the-data-parallel-trainer
        raise NotImplementedError(
            "TODO 1.4: run one data-parallel step on this rank's batch and report what it cost "
            "(see phase1_data_parallel/guidelines.md#14-the-data-parallel-trainer)"
        )

    def reduce_totals(self, totals: dict[str, float]) -> dict[str, float]:
        """This rank's sums for the epoch -> the sums over every rank of the group."""
        # TODO 1.4: sum each of this rank's epoch totals over all ranks of the loop's group.
        # Invariant: every rank returns the same dict, with the same keys, whose values are the
        #   exact sums over the group (so rank 0 can print them, and any rank could).
        # Hint 1: what does each collective cost, and how many values can one carry?
        # More hints: uv run python -m tests.hint 1.4
        # See guidelines.md#14-the-data-parallel-trainer
        raise NotImplementedError(
            "TODO 1.4: sum each of this rank's epoch totals over all ranks of the loop's group "
            "(see phase1_data_parallel/guidelines.md#14-the-data-parallel-trainer)"
        )


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
