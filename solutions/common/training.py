"""A small data-parallel training loop that phase 2+ demos share (not an exercise).

Each demo (gradient accumulation, mixed precision, checkpointing) passes its own ``step``
function; this loop does the rest the same way every time: the built-in dataset, a
DistributedSampler with ``set_epoch``, DistributedDataParallel, evaluation on a sharded test set,
and one line per epoch on rank 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from solutions.common.cli import refuse_before_start
from solutions.common.datasets import PatternSpec, make_pattern_dataset
from solutions.common.distributed import DistInfo
from solutions.common.rank_logging import log0

StepFn = Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor], float]


@dataclass
class LoopConfig:
    epochs: int = 3
    global_batch_size: int = 128
    lr: float = 0.05
    momentum: float = 0.9
    train_samples: int = 4096
    test_samples: int = 1024
    seed: int = 0


@dataclass
class EpochSummary:
    epoch: int
    loss: float
    test_accuracy: float
    samples_per_second: float


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset: Dataset, device: torch.device, batch_size: int = 256
) -> float:
    """Accuracy over the whole dataset: each rank scores a disjoint slice, counts are summed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    indices = list(range(rank, len(dataset), world))  # type: ignore[arg-type]
    loader = DataLoader(Subset(dataset, indices), batch_size=batch_size)
    was_training = model.training
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for inputs, targets in loader:
        predictions = model(inputs.to(device)).argmax(dim=1)
        counts[0] += (predictions == targets.to(device)).sum()
        counts[1] += targets.numel()
    model.train(was_training)
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def check_global_batch(global_batch_size: int, world_size: int, multiple_of: int = 1) -> int:
    """The per-rank batch, or a ValueError naming the bad value and a size that works."""
    unit = world_size * multiple_of
    if global_batch_size < unit or global_batch_size % unit:
        raise ValueError(
            f"global batch {global_batch_size} is not divisible by world size {world_size}"
            + (f" x {multiple_of} micro-batches" if multiple_of > 1 else "")
            + f": use a multiple of {unit}, e.g. {max(unit, global_batch_size // unit * unit)}"
        )
    return global_batch_size // world_size


def global_batch_error(global_batch_size: int) -> int | None:
    """Before joining the process group: exit code 2 (after saying why on rank 0) if the batch
    cannot be split evenly over torchrun's WORLD_SIZE; None if it can."""
    return refuse_before_start(lambda world: check_global_batch(global_batch_size, world))


def train_data_parallel(
    model: nn.Module, step: StepFn, config: LoopConfig, info: DistInfo, wrap_ddp: bool = True
) -> list[EpochSummary]:
    """Train ``model`` on the built-in data with ``step`` doing each optimizer step."""
    per_rank = check_global_batch(config.global_batch_size, info.world_size)
    spec = PatternSpec()
    train_set = make_pattern_dataset(config.train_samples, spec, split_seed=0)
    test_set = make_pattern_dataset(config.test_samples, spec, split_seed=1)
    model = model.to(info.device)
    trained: nn.Module = DistributedDataParallel(model) if wrap_ddp else model
    optimizer = torch.optim.SGD(trained.parameters(), lr=config.lr, momentum=config.momentum)
    sampler: DistributedSampler[int] = DistributedSampler(train_set, seed=config.seed)
    loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler)
    summaries = []
    for epoch in range(config.epochs):
        sampler.set_epoch(epoch)
        started = time.perf_counter()
        totals = torch.zeros(2, dtype=torch.float64, device=info.device)
        for inputs, targets in loader:
            inputs, targets = inputs.to(info.device), targets.to(info.device)
            loss = step(trained, optimizer, inputs, targets)
            totals += torch.tensor([loss * targets.numel(), targets.numel()], device=info.device)
        dist.all_reduce(totals)
        elapsed = time.perf_counter() - started
        accuracy = evaluate(model, test_set, info.device)
        summary = EpochSummary(
            epoch, float(totals[0] / totals[1]), accuracy, float(totals[1]) / elapsed
        )
        summaries.append(summary)
        log0(
            f"epoch {epoch + 1}/{config.epochs}  loss {summary.loss:.4f}  "
            f"test acc {100 * accuracy:5.1f}%  {summary.samples_per_second:8.0f} samples/s"
        )
    return summaries
