# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase1.py
"""Exercises 1.2 and 1.4: synchronous data-parallel training, built by hand.

Every rank holds a full copy of the model. Each step, each rank runs forward and backward on its
own B/N samples, then the ranks average their gradients, so every rank applies the same update
and the copies never drift apart. With equal shards, the mean of the N local mean-gradients is
the gradient of the mean loss over all B samples: N ranks on B/N samples each take exactly the
step one process would take on B (up to floating-point rounding). This is what
``torch.nn.parallel.DistributedDataParallel`` does (Li et al., "PyTorch Distributed: Experiences
on Accelerating Data Parallel Training", VLDB 2020), minus its bucketing and overlap (phase 3).

Every function takes ``group=`` (None: the default group), so the same code trains inside a
data-parallel subgroup; ranks given as arguments (``src``) are ranks within that group. The epoch
loop itself is the course's one loop, ``course/training.py``; 1.4 plugs phase 1's parts
into it (:class:`DataParallelLoop`).

Run it (instructor command; any world size that divides the global batch):

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase1_data_parallel.trainer
    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase1_data_parallel.trainer \
        --all-reduce reduce_broadcast
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from course.cli import parse_config, refuse_before_start, run_main
from course.comm_counter import CommCounter
from course.datasets import PatternSpec, make_pattern_dataset
from course.distributed import (
    current_info,
    distributed_session,
)
from course.models import MLP, BabyCNN
from course.rank_logging import log0
from course.seeding import seed_everything
from course.training import Callback, StepOutput, TrainingLoop, evaluate
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
MODELS = ("cnn", "mlp")


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
    # Hint 1: one collective per tensor does it; buffers (e.g. BatchNorm running stats) are
    #   model state too.
    # More hints: uv run python -m tests.hint 1.2
    # See guidelines.md#12-broadcast-and-gradient-averaging
    raise NotImplementedError(
        "TODO 1.2: copy rank src's parameters AND buffers to every other rank, in place "
        "(see phase1_data_parallel/guidelines.md#12-broadcast-and-gradient-averaging)"
    )


def average_gradients(
    model: nn.Module,
    all_reduce_fn: AllReduceFn | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Replace every ``.grad`` with its mean over the ranks of ``group``; return the bytes
    all-reduced.

    ``all_reduce_fn(tensor, group=group)`` sums in place (default ``dist.all_reduce``). Parameters
    without a gradient (frozen, or unused in this forward) are skipped; every rank must agree on
    which those are. Gradients are packed into one flat buffer per dtype so the step pays one
    message latency instead of one per parameter.
    """
    all_reduce = all_reduce_fn or dist.all_reduce
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0
    # TODO 1.2: average the gradients across the group's ranks, in place, with all_reduce.
    # Invariant: afterwards every rank's p.grad is the mean over the group (sum / group size),
    #   identical on all its ranks; the returned int is the bytes passed to all_reduce.
    # Hint 1: all-reduce sums; divide by the group's size, dist.get_world_size(group).
    #   Flattening all gradients into one buffer makes one call instead of one per tensor;
    #   group by dtype if the model mixes dtypes.
    # More hints: uv run python -m tests.hint 1.2
    # See guidelines.md#12-broadcast-and-gradient-averaging
    raise NotImplementedError(
        "TODO 1.2: average the gradients across the group's ranks, in place, with all_reduce "
        "(see phase1_data_parallel/guidelines.md#12-broadcast-and-gradient-averaging)"
    )


@dataclass
class StepStats:
    """What one data-parallel step cost and produced, on this rank."""

    loss: float
    compute_seconds: float
    communication_seconds: float
    bytes_reduced: int


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    # Hint 1: zero the grads (set_to_none=True keeps "no gradient" distinguishable), forward,
    #   loss, backward; average_gradients(model, all_reduce_fn, group=group); optimizer.step().
    #   Time with time.perf_counter(); call _synchronize(inputs.device) before reading the
    #   clock on GPUs.
    # More hints: uv run python -m tests.hint 1.2
    # See guidelines.md#12-broadcast-and-gradient-averaging
    raise NotImplementedError(
        "TODO 1.2: one data-parallel step, timed in two parts "
        "(see phase1_data_parallel/guidelines.md#12-broadcast-and-gradient-averaging)"
    )


# ----------------------------------------------------------------------------- exercise 1.4


@dataclass
class TrainConfig:
    """Everything a training run depends on; every rank must be given the same values."""

    epochs: int = 5
    global_batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    model: str = "cnn"
    all_reduce: str = "torch"
    train_samples: int = 4096
    test_samples: int = 1024
    seed: int = 0


@dataclass
class EpochStats:
    """One epoch, summed or averaged over all ranks of the group."""

    epoch: int
    loss: float
    test_accuracy: float
    samples_per_second: float
    compute_seconds: float
    communication_seconds: float
    bytes_reduced_per_step: int
    bytes_sent_per_step: float
    samples: int  # samples trained on by all ranks together (padding repeats included)

    @property
    def communication_share(self) -> float:
        total = self.compute_seconds + self.communication_seconds
        return self.communication_seconds / total if total > 0 else 0.0


@dataclass
class TrainResult:
    config: TrainConfig
    epochs: list[EpochStats] = field(default_factory=list)
    model: nn.Module | None = None


def validate_config(config: TrainConfig, world_size: int) -> None:
    """Refuse a run that cannot work, before any process group or data exists."""
    if world_size < 1:
        raise ValueError(f"world size {world_size}: need at least one process")
    # TODO 1.4: refuse a global batch the world cannot split evenly, and an unknown strategy.
    # Invariant: a bad run fails here, before any process group, data or model exists, with a
    #   message that names the bad value and the fix.
    # Hint 1: unequal per-rank batches break the "mean of means = global mean" argument and
    #   give ranks different step counts; ALL_REDUCE_STRATEGIES lists the valid names.
    # More hints: uv run python -m tests.hint 1.4
    # See guidelines.md#14-the-data-parallel-trainer
    raise NotImplementedError(
        "TODO 1.4: refuse a global batch the world cannot split evenly, and an unknown strategy "
        "(see phase1_data_parallel/guidelines.md#14-the-data-parallel-trainer)"
    )
    if config.model not in MODELS:
        raise ValueError(f"--model {config.model!r} is unknown: choose one of {', '.join(MODELS)}")
    if config.epochs < 1:
        raise ValueError(f"--epochs {config.epochs}: train for at least one epoch")
    if config.train_samples < config.global_batch_size:
        raise ValueError(
            f"--train-samples {config.train_samples} is smaller than one global batch "
            f"({config.global_batch_size}): use more samples or a smaller batch"
        )


def build_model(config: TrainConfig, spec: PatternSpec) -> nn.Module:
    if config.model == "cnn":
        return BabyCNN(in_channels=1, num_classes=spec.num_classes)
    return MLP(spec.image_size * spec.image_size, hidden=128, num_classes=spec.num_classes)


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
        # Invariant: each rank steps on its own batch, averaging over `group` with the chosen
        #   all-reduce; `loss` is the batch's mean loss and `samples` its size, so the loop's
        #   sum loss x samples over the epoch is exact.
        # Hint 1: data_parallel_step (1.2) does the work; count this rank's sends by running it
        #   inside `with CommCounter() as comm:` and reading comm.bytes_sent afterwards.
        # More hints: uv run python -m tests.hint 1.4
        # See guidelines.md#14-the-data-parallel-trainer
        raise NotImplementedError(
            "TODO 1.4: run one data-parallel step on this rank's batch and report what it cost "
            "(see phase1_data_parallel/guidelines.md#14-the-data-parallel-trainer)"
        )

    def reduce_totals(self, totals: dict[str, float]) -> dict[str, float]:
        """This rank's sums for the epoch -> the sums over every rank of the group."""
        # TODO 1.4: sum each of this rank's epoch totals over all ranks of the group.
        # Invariant: every rank returns the same dict, with the same keys, whose values are the
        #   sums over the group (so rank 0 can print them, and any rank could).
        # Hint 1: one all-reduce of all the values at once, not one per key; every rank must
        #   put the keys in the same order.
        # More hints: uv run python -m tests.hint 1.4
        # See guidelines.md#14-the-data-parallel-trainer
        raise NotImplementedError(
            "TODO 1.4: sum each of this rank's epoch totals over all ranks of the group "
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
    spec = PatternSpec()
    seed_everything(config.seed)
    model = build_model(config, spec).to(info.device)
    broadcast_parameters(model, src=0, group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    train_set = make_pattern_dataset(config.train_samples, spec, split_seed=0)
    test_set = make_pattern_dataset(config.test_samples, spec, split_seed=1)
    sampler = DistributedShardSampler(train_set, shuffle=True, seed=config.seed, group=group)
    loader = DataLoader(train_set, batch_size=config.global_batch_size // world, sampler=sampler)
    all_reduce_fn = ALL_REDUCE_STRATEGIES[config.all_reduce]
    loop = DataParallelLoop(
        model,
        optimizer,
        loader,
        sampler,
        device=info.device,
        all_reduce_fn=all_reduce_fn,
        group=group,
    )
    result = TrainResult(config=config)
    log0(
        f"data parallel: world {world}, backend {info.backend}, device {info.device.type}, "
        f"model {config.model}, all-reduce {config.all_reduce}, global batch "
        f"{config.global_batch_size} ({config.global_batch_size // world} per rank)"
    )
    for epoch in range(config.epochs):
        epoch_result = loop.run_epoch(epoch)
        accuracy = evaluate(model, test_set, info.device, group=group)
        totals = epoch_result.totals
        steps = totals["steps"] / world
        stats = EpochStats(
            epoch=epoch,
            loss=totals["loss_sum"] / totals["samples"],
            test_accuracy=accuracy,
            samples_per_second=totals["samples"] / epoch_result.seconds,
            compute_seconds=totals["compute_seconds"] / world,
            communication_seconds=totals["communication_seconds"] / world,
            bytes_reduced_per_step=round(totals["bytes_reduced"] / world / steps),
            bytes_sent_per_step=totals["bytes_sent"] / world / steps,
            samples=round(totals["samples"]),
        )
        result.epochs.append(stats)
        sent = (
            f"{stats.bytes_sent_per_step / 2**20:.3f} MiB sent/rank"
            if config.all_reduce != "torch"
            else "sent inside the backend"
        )
        log0(
            f"epoch {epoch + 1}/{config.epochs}  loss {stats.loss:.4f}  "
            f"test acc {100 * accuracy:5.1f}%  {stats.samples_per_second:8.0f} samples/s  "
            f"comm {100 * stats.communication_share:4.1f}% of step  "
            f"payload {stats.bytes_reduced_per_step / 2**20:.3f} MiB/step  {sent}"
        )
    result.model = model
    return result


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(TrainConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate_config(config, world))) is not None:
        return code
    with distributed_session():
        train(config)
    return 0


if __name__ == "__main__":
    run_main(main)
