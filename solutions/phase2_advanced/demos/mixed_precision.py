"""Demo of exercise 2.2: data-parallel training in fp32, bf16 or fp16 with the hand-made scaler.

Trains ``BabyCNN`` under ``DistributedDataParallel`` with ``mixed_precision_step``, clipping at
``--max-grad-norm``. Loss scaling is on for fp16 only (bf16 has fp32's range). ``--impl
templates`` runs your own ``phase2_advanced/template_mixed_precision.py``.

    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.demos.mixed_precision
    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.demos.mixed_precision --precision fp16 --impl templates
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from course.cli import parse_config, refuse_before_start, run_main
from course.distributed import distributed_session
from course.impl import IMPLS, load_impl
from course.models import BabyCNN
from course.rank_logging import log0
from course.seeding import seed_everything
from course.training import LoopConfig, train_data_parallel
from solutions.phase2_advanced.demos.support import batch_problems, bound_problems, record_demo

PHASE = "phase2_advanced"
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PrecisionConfig:
    """Flags of the demo; every rank must be given the same values."""

    precision: str = field(
        default="bf16", metadata={"choices": tuple(PRECISIONS), "help": "autocast dtype"}
    )
    epochs: int = field(
        default=3, metadata={"bounds": {"ge": 1, "fix": "train for at least one epoch"}}
    )
    global_batch_size: int = field(
        default=128,
        metadata={"bounds": {"ge": 1, "fix": "a multiple of the number of processes, e.g. 128"}},
    )
    max_grad_norm: float = field(
        default=1.0,
        metadata={
            "help": "clip at this norm; 0: off",
            "fix": "0 (off) or a norm > 0",
            "bounds": {"ge": 0, "fix": "0 (off) or a norm > 0"},
        },
    )
    growth_interval: int = field(
        default=50,
        metadata={
            "help": "fp16: clean steps to grow",
            "bounds": {"ge": 1, "fix": "e.g. 50 clean steps"},
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


def validate(config: PrecisionConfig, world_size: int) -> None:
    """Every bad flag at once, naming each: raised before the process group exists."""
    problems = bound_problems(config)
    problems += batch_problems(config.global_batch_size, config.train_samples, world_size)
    if problems:
        raise ValueError("; ".join(problems))


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(PrecisionConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate(config, world))) is not None:
        return code
    precision = load_impl(PHASE, "mixed_precision", config.impl)
    with distributed_session() as info:
        seed_everything(0)
        dtype = PRECISIONS[config.precision]
        # fp16 needs loss scaling; bf16 has fp32's range and does not
        scaler = precision.DynamicLossScaler(
            growth_interval=config.growth_interval, enabled=dtype is torch.float16
        )
        max_norm = config.max_grad_norm or None
        skipped = 0

        def step(
            model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
        ) -> float:
            nonlocal skipped
            loss, stepped = precision.mixed_precision_step(
                model, optimizer, nn.functional.cross_entropy, x, y, scaler, dtype, max_norm
            )
            skipped += not stepped
            return float(loss)

        log0(
            f"mixed precision ({config.impl}): {config.precision} autocast on "
            f"{info.device.type}, loss scaling {'on' if scaler.enabled else 'off'}, "
            f"world {info.world_size}"
        )
        loop = LoopConfig(
            epochs=config.epochs,
            global_batch_size=config.global_batch_size,
            train_samples=config.train_samples,
        )
        summaries = train_data_parallel(BabyCNN(), step, loop, info)
        log0(f"final loss scale {scaler.get_scale():g}, skipped steps {skipped}")
        record_demo(
            config.record,
            summaries,
            {"final_scale": f"{scaler.get_scale():g}", "skipped_steps": str(skipped)},
        )
    return 0


if __name__ == "__main__":
    run_main(main)
