# Exercise template generated from solutions/phase1_data_parallel/trainer.py.
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

Run it (instructor command; any world size that divides the global batch):

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase1_data_parallel.trainer
    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase1_data_parallel.trainer \
        --all-reduce reduce_broadcast
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from solutions.common.cli import parse_config, refuse_before_start
from solutions.common.comm_counter import CommCounter
from solutions.common.datasets import PatternSpec, make_pattern_dataset
from solutions.common.distributed import (
    current_info,
    distributed_session,
)
from solutions.common.models import MLP, BabyCNN
from solutions.common.rank_logging import log0
from solutions.common.seeding import seed_everything
from solutions.common.training import evaluate
from phase1_data_parallel.template_all_reduce import (
    direct_exchange_all_reduce,
    reduce_broadcast_all_reduce,
)
from phase1_data_parallel.template_data_loader import DistributedShardSampler

AllReduceFn = Callable[[torch.Tensor], Any]

ALL_REDUCE_STRATEGIES: dict[str, AllReduceFn] = {
    "torch": dist.all_reduce,
    "reduce_broadcast": reduce_broadcast_all_reduce,
    "direct_exchange": direct_exchange_all_reduce,
}
MODELS = ("cnn", "mlp")


# ----------------------------------------------------------------------------- exercise 1.2


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s, in place.

    Seeding alone is not enough: a different library version, device or initialisation order
    on one rank would silently train N different models.
    """
    # TODO 1.2: copy rank src's parameters AND buffers to every other rank, in place.
    # Invariant: afterwards all ranks hold bitwise-identical model state; the tensors
    #   themselves are updated (the optimizer keeps references to them).
    # Hint 1: one collective per tensor does it; buffers (e.g. BatchNorm running stats) are
    #   model state too.
    # Hint 2: for t in itertools.chain(model.parameters(), model.buffers()):
    #   dist.broadcast(t.data, src=src)
    # See guidelines.md#12-broadcast-and-gradient-averaging
    raise NotImplementedError(
        "TODO 1.2: copy rank src's parameters AND buffers to every other rank, in place "
        "(see phase1_data_parallel/guidelines.md#12-broadcast-and-gradient-averaging)"
    )


def average_gradients(model: nn.Module, all_reduce_fn: AllReduceFn | None = None) -> int:
    """Replace every ``.grad`` with its mean over all ranks; return the bytes all-reduced.

    Parameters without a gradient (frozen, or unused in this forward) are skipped; every rank
    must agree on which those are. Gradients are packed into one flat buffer per dtype so the
    step pays one message latency instead of one per parameter.
    """
    all_reduce = all_reduce_fn or dist.all_reduce
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0
    # TODO 1.2: average the gradients across ranks, in place, with all_reduce.
    # Invariant: afterwards every rank's p.grad is the mean over ranks (sum / world size),
    #   identical on all ranks; the returned int is the bytes passed to all_reduce.
    # Hint 1: all-reduce sums; divide by dist.get_world_size(). Flattening all gradients into
    #   one buffer (torch.cat of g.reshape(-1)) makes one call instead of one per tensor;
    #   group by dtype if the model mixes dtypes.
    # Hint 2: flat = torch.cat([g.reshape(-1) for g in same_dtype]); all_reduce(flat);
    #   flat.div_(world); then copy slices back with g.copy_(flat[o:o + g.numel()].view_as(g)).
    # See guidelines.md#12-broadcast-and-gradient-averaging
    raise NotImplementedError(
        "TODO 1.2: average the gradients across ranks, in place, with all_reduce "
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
) -> StepStats:
    """One synchronous step on this rank's batch: forward, backward, average gradients, update.

    Returns this rank's loss and the time spent computing vs communicating. The communication
    time includes waiting for the slowest rank: a straggler shows up here.
    """
    # TODO 1.2: one data-parallel step, timed in two parts.
    # Invariant: after the step, all ranks hold identical weights equal to one process
    #   stepping on the union of the batches; gradients from the last step never leak in.
    # Hint 1: zero the grads (set_to_none=True keeps "no gradient" distinguishable), forward,
    #   loss, backward; average_gradients(model, all_reduce_fn); optimizer.step(). Time with
    #   time.perf_counter(); call _synchronize(inputs.device) before reading the clock on GPUs.
    # Hint 2: compute = (backward done - start) + (step done - averaging done);
    #   communication = averaging done - backward done;
    #   return StepStats(loss.item(), compute, communication, bytes_from_average_gradients).
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
    """One epoch, summed or averaged over all ranks."""

    epoch: int
    loss: float
    test_accuracy: float
    samples_per_second: float
    compute_seconds: float
    communication_seconds: float
    bytes_reduced_per_step: int
    bytes_sent_per_step: float

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
    # Hint 2: if global_batch_size % world_size (or it is < world_size): raise ValueError(
    #   f"--global-batch-size {b} is not divisible by the world size {n}: ... use a multiple
    #   of {n}"); if all_reduce not in ALL_REDUCE_STRATEGIES: raise ValueError naming choices.
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


def run_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    sampler: DistributedShardSampler,
    epoch: int,
    all_reduce_fn: AllReduceFn,
    device: torch.device,
) -> dict[str, float]:
    """Train one epoch on this rank's shard; return totals summed over ALL ranks.

    Keys: loss_sum (sum of per-sample losses), samples, steps, compute_seconds and
    communication_seconds (summed over ranks), bytes_reduced and bytes_sent (summed over ranks).
    """
    loss_fn = nn.CrossEntropyLoss()
    # TODO 1.4: the epoch loop of the data-parallel trainer.
    # Invariant: every rank runs the same number of steps; the totals returned are the same on
    #   every rank (reduced over all ranks), so rank 0 can print them.
    # Hint 1: reshuffle with sampler.set_epoch(epoch) first (forgetting it repeats epoch 0's
    #   order forever). For each batch: move it to device, data_parallel_step(...), add
    #   stats.loss * batch size to the loss sum. Count bytes this rank sends by running the
    #   loop inside `with CommCounter() as comm:` and reading comm.bytes_sent afterwards.
    # Hint 2: totals = torch.tensor([loss_sum, samples, steps, compute, comm_s, bytes_reduced,
    #   bytes_sent], dtype=torch.float64, device=device); dist.all_reduce(totals);
    #   return dict(zip(keys, totals.tolist())).
    # See guidelines.md#14-the-data-parallel-trainer
    raise NotImplementedError(
        "TODO 1.4: the epoch loop of the data-parallel trainer "
        "(see phase1_data_parallel/guidelines.md#14-the-data-parallel-trainer)"
    )


def train(config: TrainConfig) -> TrainResult:
    """Train inside an existing process group (torchrun's, or a test world's)."""
    info = current_info()
    validate_config(config, info.world_size)
    spec = PatternSpec()
    seed_everything(config.seed)
    model = build_model(config, spec).to(info.device)
    broadcast_parameters(model, src=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    train_set = make_pattern_dataset(config.train_samples, spec, split_seed=0)
    test_set = make_pattern_dataset(config.test_samples, spec, split_seed=1)
    sampler = DistributedShardSampler(
        train_set, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=config.seed
    )
    loader = DataLoader(
        train_set, batch_size=config.global_batch_size // info.world_size, sampler=sampler
    )
    all_reduce_fn = ALL_REDUCE_STRATEGIES[config.all_reduce]
    result = TrainResult(config=config)
    world = info.world_size
    log0(
        f"data parallel: world {world}, backend {info.backend}, device {info.device.type}, "
        f"model {config.model}, all-reduce {config.all_reduce}, global batch "
        f"{config.global_batch_size} ({config.global_batch_size // world} per rank)"
    )
    for epoch in range(config.epochs):
        started = time.perf_counter()
        totals = run_epoch(model, optimizer, loader, sampler, epoch, all_reduce_fn, info.device)
        elapsed = time.perf_counter() - started
        accuracy = evaluate(model, test_set, info.device)
        steps = totals["steps"] / world
        stats = EpochStats(
            epoch=epoch,
            loss=totals["loss_sum"] / totals["samples"],
            test_accuracy=accuracy,
            samples_per_second=totals["samples"] / elapsed,
            compute_seconds=totals["compute_seconds"] / world,
            communication_seconds=totals["communication_seconds"] / world,
            bytes_reduced_per_step=round(totals["bytes_reduced"] / world / steps),
            bytes_sent_per_step=totals["bytes_sent"] / world / steps,
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
    sys.exit(main())
