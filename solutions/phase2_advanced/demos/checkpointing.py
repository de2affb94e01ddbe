"""Demo of exercise 2.3: a deep MLP's saved activations with and without checkpointing, then DDP.

Builds a deep MLP (Flatten, an input Linear, ``--depth`` Linear+ReLU blocks, a classifier),
measures the peak bytes autograd keeps for backward on 64 samples, plain and checkpointed, and
trains it as a ``CheckpointedSequential`` under ``DistributedDataParallel``. ``--impl templates``
runs your own ``phase2_advanced/template_activation_checkpointing.py``.

    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.demos.checkpointing
    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.demos.checkpointing --impl templates
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from course.cli import parse_config, refuse_before_start, run_main
from course.datasets import PatternSpec, make_pattern_dataset
from course.distributed import distributed_session
from course.impl import IMPLS, load_impl
from course.memory import SavedTensorMeter
from course.rank_logging import log0
from course.seeding import seed_everything
from course.training import LoopConfig, train_data_parallel
from solutions.phase2_advanced.demos.support import batch_problems, bound_problems, record_demo

PHASE = "phase2_advanced"


def deep_mlp(
    depth: int,
    width: int,
    in_features: int | None = None,
    num_classes: int | None = None,
    dropout: float = 0.0,
) -> nn.Sequential:
    """Linear -> ReLU (-> Dropout) blocks, ``depth`` of them: deep enough for checkpointing to
    matter. ``in_features`` adds a Flatten + input projection, ``num_classes`` a classifier."""
    layers: list[nn.Module] = []
    if in_features is not None:
        layers += [nn.Flatten(), nn.Linear(in_features, width)]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
    if num_classes is not None:
        layers.append(nn.Linear(width, num_classes))
    for layer in layers:  # He initialisation keeps a deep ReLU stack trainable (He et al. 2015)
        if isinstance(layer, nn.Linear):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


def peak_saved_bytes(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Peak bytes autograd holds for backward during one forward + backward of ``model``."""
    with SavedTensorMeter(exclude=model.parameters()) as meter:
        nn.functional.cross_entropy(model(inputs), targets).backward()
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes


@dataclass
class CheckpointingConfig:
    """Flags of the demo; every rank must be given the same values."""

    depth: int = field(
        default=8,
        metadata={"help": "Linear+ReLU blocks", "bounds": {"ge": 1, "fix": "e.g. --depth 8"}},
    )
    width: int = field(default=256, metadata={"bounds": {"ge": 1, "fix": "e.g. --width 256"}})
    segments: int = field(
        default=0,
        metadata={
            "help": "0: about sqrt(depth)",
            "bounds": {"ge": 0, "fix": "0 (about sqrt(depth)) or more"},
        },
    )
    global_batch_size: int = field(
        default=128,
        metadata={"bounds": {"ge": 1, "fix": "a multiple of the number of processes, e.g. 128"}},
    )
    epochs: int = field(
        default=3, metadata={"bounds": {"ge": 1, "fix": "train for at least one epoch"}}
    )
    train_samples: int = field(
        default=4096, metadata={"bounds": {"ge": 1, "fix": "at least one global batch of samples"}}
    )
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference or your phase2_advanced templates"},
    )
    record: str = field(
        default="", metadata={"help": "rank 0 also writes the run to this results file (JSON)"}
    )


def layer_count(config: CheckpointingConfig) -> int:
    """Modules of the demo's MLP: Flatten, input Linear, depth x (Linear, ReLU), classifier."""
    return 2 * config.depth + 3


def validate(config: CheckpointingConfig, world_size: int) -> None:
    """Every bad flag at once, naming each: raised before the process group exists."""
    problems = bound_problems(config)
    layers = layer_count(config)
    if config.depth >= 1 and not 0 <= config.segments <= layers:
        problems.append(
            f"--segments {config.segments}: the MLP has {layers} modules, use 1 to {layers} "
            "(or 0 for about sqrt(depth))"
        )
    problems += batch_problems(config.global_batch_size, config.train_samples, world_size)
    if problems:
        raise ValueError("; ".join(problems))


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(CheckpointingConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate(config, world))) is not None:
        return code
    checkpointing = load_impl(PHASE, "activation_checkpointing", config.impl)
    with distributed_session() as info:
        seed_everything(0)
        spec = PatternSpec()
        layers = deep_mlp(config.depth, config.width, spec.image_size**2, spec.num_classes)
        # a Linear+ReLU block keeps one activation: sqrt of the block count minimises memory
        segments = config.segments or max(2, math.isqrt(config.depth))
        model = checkpointing.CheckpointedSequential(layers, segments).to(info.device)
        sample = make_pattern_dataset(64, spec, split_seed=2)
        x, y = (t.to(info.device) for t in sample.tensors)
        plain, checkpointed = peak_saved_bytes(layers, x, y), peak_saved_bytes(model, x, y)
        log0(
            f"checkpointing ({config.impl}): {len(layers)} layers in {segments} segments, world "
            f"{info.world_size}; peak saved for backward per 64 samples: plain "
            f"{plain / 2**20:.2f} MiB, checkpointed {checkpointed / 2**20:.2f} MiB "
            f"({checkpointed / plain:.2f}x)"
        )

        def step(
            ddp: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
        ) -> float:
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            optimizer.step()
            return loss.item()

        loop = LoopConfig(
            epochs=config.epochs,
            global_batch_size=config.global_batch_size,
            lr=0.01,
            train_samples=config.train_samples,
        )
        summaries = train_data_parallel(model, step, loop, info)
        record_demo(
            config.record,
            summaries,
            {
                "plain_mib": f"{plain / 2**20:.2f} MiB",
                "checkpointed_mib": f"{checkpointed / 2**20:.2f} MiB",
                "ratio": f"{checkpointed / plain:.2f}x",
                "segments": str(segments),
            },
        )
    return 0


if __name__ == "__main__":
    run_main(main)
