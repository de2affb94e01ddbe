"""Demo of exercise 2.1: data-parallel training with gradient accumulation under DDP.

Trains ``BabyCNN`` under ``DistributedDataParallel`` with ``ddp_accumulation_step`` and counts
DDP's bucket all-reduces with a communication hook: with ``no_sync`` there is one per bucket per
optimizer step, whatever the number of micro-batches. ``--impl templates`` runs your own
``phase2_advanced/template_gradient_accumulation.py``.

    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.demos.accumulation
    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.demos.accumulation --impl templates
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from course.cli import parse_config, refuse_before_start, run_main
from course.distributed import distributed_session
from course.impl import IMPLS, load_impl
from course.models import BabyCNN
from course.rank_logging import log0
from course.seeding import seed_everything
from course.training import LoopConfig, check_global_batch, train_data_parallel
from solutions.phase2_advanced.demos.support import batch_problems, bound_problems, record_demo

PHASE = "phase2_advanced"


class AllReduceCount:
    """How many bucket all-reduces DDP launched: the state of :func:`counting_allreduce_hook`."""

    def __init__(self) -> None:
        self.calls = 0


def counting_allreduce_hook(
    state: AllReduceCount, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: count the call, then do PyTorch's default all-reduce.

    Register with ``ddp_model.register_comm_hook(AllReduceCount(), counting_allreduce_hook)``
    (default hook: torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py). It all-reduces
    over the DDP model's own process group.
    """
    state.calls += 1
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


# DDP checks a hook's annotations against the real classes; `from __future__ import annotations`
# turned them into strings, so give them back as objects.
counting_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)


@dataclass
class AccumulationConfig:
    """Flags of the demo; every rank must be given the same values."""

    epochs: int = field(
        default=3, metadata={"bounds": {"ge": 1, "fix": "train for at least one epoch"}}
    )
    global_batch_size: int = field(
        default=256,
        metadata={
            "help": "samples per optimizer step, over all ranks",
            "bounds": {"ge": 1, "fix": "a multiple of the number of processes, e.g. 256"},
        },
    )
    micro_batch_size: int = field(
        default=32,
        metadata={"help": "samples per forward/backward", "bounds": {"ge": 1, "fix": "e.g. 32"}},
    )
    lr: float = field(
        default=0.05,
        metadata={
            "fix": "a positive learning rate, e.g. 0.05",
            "bounds": {"gt": 0, "fix": "a positive learning rate, e.g. 0.05"},
        },
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


def validate(config: AccumulationConfig, world_size: int) -> None:
    """Every bad flag at once, naming each: raised before the process group exists."""
    problems = bound_problems(config)
    problems += batch_problems(config.global_batch_size, config.train_samples, world_size)
    if problems:
        raise ValueError("; ".join(problems))


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(AccumulationConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate(config, world))) is not None:
        return code
    accumulation = load_impl(PHASE, "gradient_accumulation", config.impl)
    with distributed_session() as info:
        seed_everything(0)
        per_rank = check_global_batch(config.global_batch_size, info.world_size)
        counter = AllReduceCount()
        steps = 0

        def step(
            model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
        ) -> float:
            nonlocal steps
            steps += 1
            assert isinstance(model, DistributedDataParallel)
            return float(
                accumulation.ddp_accumulation_step(
                    model, optimizer, nn.functional.cross_entropy, x, y, config.micro_batch_size
                )
            )

        micro = -(-per_rank // config.micro_batch_size)
        log0(
            f"accumulation ({config.impl}): world {info.world_size}, global batch "
            f"{config.global_batch_size} = {info.world_size} ranks x {micro} micro-batches of "
            f"<= {config.micro_batch_size}"
        )
        loop = LoopConfig(
            epochs=config.epochs,
            global_batch_size=config.global_batch_size,
            lr=config.lr,
            train_samples=config.train_samples,
        )
        ddp = DistributedDataParallel(BabyCNN().to(info.device))
        ddp.register_comm_hook(counter, counting_allreduce_hook)
        summaries = train_data_parallel(ddp, step, loop, info, wrap_ddp=False)
        log0(
            f"DDP bucket all-reduces: {counter.calls} over {steps} optimizer steps "
            f"({counter.calls / max(steps, 1):.1f} per step; {micro} micro-batches per step)"
        )
        record_demo(
            config.record,
            summaries,
            {
                "bucket_all_reduces": f"{counter.calls} over {steps} optimizer steps",
                "per_step": f"{counter.calls / max(steps, 1):.1f}",
                "micro_batches": str(micro),
            },
        )
    return 0


if __name__ == "__main__":
    run_main(main)
