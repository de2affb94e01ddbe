"""The given parts of the phase 1 trainer: its settings, its model and what it reports.

Not an exercise. ``template_trainer.py`` holds what you write (1.2: broadcast, gradient
averaging, the data-parallel step; 1.4: the checks and the three methods of the loop) and
imports these, so that the template shows the exercise and not the plumbing around it:

* :class:`TrainConfig`: every flag of ``python -m ...trainer``, each number bounded (a bad one is
  refused by ``course.cli.parse_config`` with one line naming the flag, before any process group
  exists);
* :func:`check_given_settings`: the checks that are not part of 1.4 (the model's name, enough
  samples for one global batch);
* :class:`StepStats`, :func:`synchronize`: what ``data_parallel_step`` returns, and a wait for
  the GPU's queued work;
* :func:`build_model`, :func:`pattern_datasets`: the model and the data;
* :class:`EpochStats`, :class:`TrainResult`, :func:`epoch_stats`, :func:`start_line`,
  :func:`epoch_line`: the numbers and lines each epoch ends with; :func:`record_run` writes them
  to a results file with ``--record PATH``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from course.datasets import PatternSpec, make_pattern_dataset
from course.distributed import DistInfo
from course.models import MLP, BabyCNN
from course.results import Table, command_line, write_results
from course.training import EpochTotals

MODELS = ("cnn", "mlp")


@dataclass
class TrainConfig:
    """Everything a training run depends on; every rank must be given the same values."""

    epochs: int = field(default=5, metadata={"ge": 1, "fix": "train for at least one epoch"})
    global_batch_size: int = field(
        default=64, metadata={"ge": 1, "fix": "a multiple of the number of processes, e.g. 64"}
    )
    lr: float = field(
        default=0.05, metadata={"gt": 0, "fix": "a positive learning rate, e.g. 0.05"}
    )
    momentum: float = field(
        default=0.9, metadata={"ge": 0, "lt": 1, "fix": "a momentum in [0, 1), e.g. 0.9"}
    )
    model: str = "cnn"
    all_reduce: str = "torch"
    train_samples: int = field(
        default=4096, metadata={"ge": 1, "fix": "at least one global batch of samples"}
    )
    test_samples: int = field(
        default=1024, metadata={"ge": 1, "fix": "at least one held-out sample, e.g. 1024"}
    )
    seed: int = field(default=0, metadata={"ge": 0, "fix": "a seed >= 0"})
    record: str = field(
        default="", metadata={"help": "rank 0 also writes the epochs to this results file (JSON)"}
    )


def check_given_settings(config: TrainConfig, world_size: int) -> None:
    """The checks of a run that 1.4 does not ask you to write: at least one process, a known
    model, and at least one global batch of training samples. ValueError names the flag."""
    if world_size < 1:
        raise ValueError(f"world size {world_size}: need at least one process")
    if config.model not in MODELS:
        raise ValueError(f"--model {config.model!r} is unknown: choose one of {', '.join(MODELS)}")
    if config.epochs < 1:
        raise ValueError(f"--epochs {config.epochs}: train for at least one epoch")
    if config.train_samples < config.global_batch_size:
        raise ValueError(
            f"--train-samples {config.train_samples} is smaller than one global batch "
            f"({config.global_batch_size}): use more samples or a smaller batch"
        )


@dataclass
class StepStats:
    """What one data-parallel step cost and produced, on this rank."""

    loss: float
    compute_seconds: float
    communication_seconds: float
    bytes_reduced: int


def synchronize(device: torch.device) -> None:
    """Return once the GPU has finished the work queued on ``device`` so far (at once on CPU).

    CUDA kernels run asynchronously: a call that launches them returns as soon as they are
    queued, before they have run.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(config: TrainConfig, spec: PatternSpec | None = None) -> nn.Module:
    """``--model cnn`` (BabyCNN) or ``mlp`` (one hidden layer of 128) for the built-in images."""
    spec = spec or PatternSpec()
    if config.model == "cnn":
        return BabyCNN(in_channels=1, num_classes=spec.num_classes)
    return MLP(spec.image_size * spec.image_size, hidden=128, num_classes=spec.num_classes)


def pattern_datasets(config: TrainConfig) -> tuple[TensorDataset, TensorDataset]:
    """The built-in generated images (``course/datasets.py``): ``config.train_samples`` to train
    on and ``config.test_samples`` held out, the same on every rank."""
    spec = PatternSpec()
    train_set = make_pattern_dataset(config.train_samples, spec, split_seed=0)
    return train_set, make_pattern_dataset(config.test_samples, spec, split_seed=1)


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


def epoch_stats(result: EpochTotals, accuracy: float, world: int) -> EpochStats:
    """One epoch's numbers from the loop's totals (sums over the ``world`` ranks of the group):
    the mean loss over every sample, and seconds and bytes per rank and per step."""
    totals = result.totals
    steps = totals["steps"] / world
    return EpochStats(
        epoch=result.epoch,
        loss=totals["loss_sum"] / totals["samples"],
        test_accuracy=accuracy,
        samples_per_second=totals["samples"] / result.seconds,
        compute_seconds=totals["compute_seconds"] / world,
        communication_seconds=totals["communication_seconds"] / world,
        bytes_reduced_per_step=round(totals["bytes_reduced"] / world / steps),
        bytes_sent_per_step=totals["bytes_sent"] / world / steps,
        samples=round(totals["samples"]),
    )



def record_run(config: TrainConfig, result: TrainResult) -> None:
    """With ``--record PATH``, rank 0 writes the epochs' numbers to a results file
    (``course/results.py``), the one a guide quotes; otherwise nothing."""
    if not config.record or (dist.is_initialized() and dist.get_rank() != 0):
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    table = Table(
        ["epoch", "loss", "test acc", "samples/s", "comm share of step", "payload MiB/step"]
    )
    for stats in result.epochs:
        table.add(
            f"{stats.epoch + 1}/{config.epochs}",
            f"{stats.loss:.4f}",
            f"{100 * stats.test_accuracy:.1f}%",
            f"{stats.samples_per_second:.0f}",
            f"{100 * stats.communication_share:.1f}%",
            f"{stats.bytes_reduced_per_step / 2**20:.3f}",
        )
    last = result.epochs[-1]
    values = {
        "final_loss": f"{last.loss:.4f}",
        "final_accuracy": f"{100 * last.test_accuracy:.1f}%",
        "comm_share": ", ".join(f"{100 * e.communication_share:.0f}%" for e in result.epochs),
        "world": str(world),
    }
    path = write_results(
        config.record, tables={"epochs": table}, values=values, command=command_line()
    )
    print(f"recorded {path}", flush=True)


def start_line(config: TrainConfig, world: int, info: DistInfo) -> str:
    """What rank 0 prints before the first epoch."""
    return (
        f"data parallel: world {world}, backend {info.backend}, device {info.device.type}, "
        f"model {config.model}, all-reduce {config.all_reduce}, global batch "
        f"{config.global_batch_size} ({config.global_batch_size // world} per rank)"
    )


def epoch_line(stats: EpochStats, config: TrainConfig) -> str:
    """What rank 0 prints after each epoch (guidelines.md#14-the-data-parallel-trainer explains
    every field)."""
    sent = (
        f"{stats.bytes_sent_per_step / 2**20:.3f} MiB sent/rank"
        if config.all_reduce != "torch"
        else "sent inside the backend"
    )
    return (
        f"epoch {stats.epoch + 1}/{config.epochs}  loss {stats.loss:.4f}  "
        f"test acc {100 * stats.test_accuracy:5.1f}%  {stats.samples_per_second:8.0f} samples/s  "
        f"comm {100 * stats.communication_share:4.1f}% of step  "
        f"payload {stats.bytes_reduced_per_step / 2**20:.3f} MiB/step  {sent}"
    )
