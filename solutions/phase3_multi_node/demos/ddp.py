"""Demo of exercise 3.4: train with DDP from scratch, then with torch's DDP, and compare.

Trains ``BabyCNN`` on the built-in data through the course's training loop
(``train_data_parallel``), wrapped in our ``DistributedDataParallel``; prints its buckets, counts
the ``dist.all_reduce`` calls per optimizer step (one per bucket), then trains the same model from
the same seed under ``torch.nn.parallel.DistributedDataParallel`` and prints both epochs' losses.
``--impl templates`` runs your own ``phase3_multi_node/template_ddp.py``.

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase3_multi_node.demos.ddp
    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase3_multi_node.demos.ddp \
        --impl templates
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course.cli import parse_config, refuse_before_start, run_main
from course.comm_counter import CommCounter
from course.distributed import distributed_session
from course.impl import IMPLS, load_impl
from course.models import BabyCNN
from course.rank_logging import log0
from course.seeding import seed_everything
from course.training import LoopConfig, check_global_batch, train_data_parallel

PHASE = "phase3_multi_node"


@dataclass
class DemoConfig:
    """Flags of the demo; every rank must be given the same values."""

    epochs: int = field(
        default=2, metadata={"ge": 1, "le": 1000, "fix": "1 to 1000 epochs, e.g. 2"}
    )
    global_batch_size: int = field(
        default=128,
        metadata={"ge": 1, "le": 1 << 16, "fix": "a multiple of the world size, e.g. 128"},
    )
    lr: float = field(
        default=0.05,
        metadata={"gt": 0, "le": 10, "fix": "a positive learning rate up to 10, e.g. 0.05"},
    )
    train_samples: int = field(
        default=2048,
        metadata={
            "ge": 1,
            "le": 1 << 20,
            "fix": "at least one global batch of samples, e.g. 2048",
        },
    )
    bucket_cap_mb: float = field(
        default=0.01,
        metadata={
            "help": "bucket size in MiB (small, so BabyCNN gets 3 buckets)",
            "ge": 0,
            "le": 1024,
            "fix": "a size in MiB from 0 (a bucket per parameter) to 1024, e.g. 25",
        },
    )
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference or your phase 3 templates"},
    )


def validate(config: DemoConfig, world_size: int) -> None:
    """Every bad flag at once, naming each: raised before the process group exists."""
    problems = []
    for name in ("epochs", "train_samples"):
        if getattr(config, name) < 1:
            problems.append(f"--{name.replace('_', '-')} {getattr(config, name)} must be >= 1")
    if config.bucket_cap_mb < 0:
        problems.append(f"--bucket-cap-mb {config.bucket_cap_mb} must be >= 0")
    try:
        check_global_batch(config.global_batch_size, world_size)
    except ValueError as err:
        problems.append(f"--global-batch-size: {err}")
    if 1 <= config.train_samples < config.global_batch_size:
        problems.append(
            f"--train-samples {config.train_samples} is fewer than one global batch "
            f"(--global-batch-size {config.global_batch_size}): not a single step would run; "
            f"use at least {config.global_batch_size}"
        )
    if problems:
        raise ValueError("; ".join(problems))


def plain_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    """An ordinary step: DDP averages the gradients inside backward()."""
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(DemoConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate(config, world))) is not None:
        return code
    ddp = load_impl(PHASE, "ddp", config.impl)
    loop = LoopConfig(
        epochs=config.epochs,
        global_batch_size=config.global_batch_size,
        lr=config.lr,
        train_samples=config.train_samples,
    )
    with distributed_session() as info:
        seed_everything(info.rank)  # different on every rank: the broadcast makes them equal
        ours = ddp.DistributedDataParallel(
            BabyCNN().to(info.device), bucket_cap_mb=config.bucket_cap_mb
        )
        log0(f"DDP from scratch ({config.impl}), world {info.world_size}, buckets in launch order:")
        for bucket in ours.buckets:
            log0(f"  bucket {bucket.index}: {bucket.nbytes:>7} bytes  {', '.join(bucket.names)}")
        steps = 0

        def counted_step(
            model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
        ) -> float:
            nonlocal steps
            steps += 1
            return plain_step(model, optimizer, x, y)

        with CommCounter() as comm:
            mine = train_data_parallel(ours, counted_step, loop, info, wrap_ddp=False)
        # train_data_parallel also all-reduces each epoch's totals and evaluation counts
        per_epoch = 2
        bucket_calls = comm.count("all_reduce") - per_epoch * config.epochs
        log0(
            f"all-reduces: {bucket_calls} over {steps} steps = {bucket_calls / max(steps, 1):.1f} "
            f"per step ({len(ours.buckets)} buckets)"
        )
        log0("torch's DistributedDataParallel, same seeds and buckets:")
        seed_everything(0)  # rank 0's seed above: torch's DDP starts from rank 0's weights too
        reference = TorchDDP(BabyCNN().to(info.device), bucket_cap_mb=config.bucket_cap_mb)
        theirs = train_data_parallel(reference, plain_step, loop, info, wrap_ddp=False)
        for a, b in zip(mine, theirs, strict=True):
            log0(
                f"epoch {a.epoch + 1}: loss ours {a.loss:.6f}  torch {b.loss:.6f}  "
                f"difference {abs(a.loss - b.loss):.1e}"
            )
    return 0


if __name__ == "__main__":
    run_main(main)
