"""Demo of exercise 2.4: naive model parallelism trained beside the single-device model.

Each rank holds a consecutive slice of the model (``model_parallel.ModelParallelStage``); every
rank also runs the whole (small) model on one device, so each step prints the model-parallel loss
next to the single-device loss, the largest gradient difference over all ranks, and the bytes
each rank sent. ``--impl templates`` runs your own ``phase2_advanced/template_model_parallel.py``.

    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.demos.model_parallel
    uv run torchrun --standalone --nproc_per_node=4 \
        -m solutions.phase2_advanced.demos.model_parallel --model cnn --dtype float64
    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.demos.model_parallel --impl templates

At most as many processes as the model has layers (the MLP has 6, the CNN 8).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from course.cli import parse_config, refuse_before_start, run_main
from course.comm_counter import CommCounter
from course.datasets import PatternSpec, make_pattern_dataset
from course.distributed import current_info, distributed_session
from course.impl import IMPLS, load_impl
from course.models import MLP, BabyCNN
from course.rank_logging import log0
from course.seeding import seed_everything
from solutions.phase2_advanced.demos.support import bound_problems

PHASE = "phase2_advanced"
MODELS = ("mlp", "cnn")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class DemoConfig:
    """The demo run; every rank must be given the same values."""

    model: str = field(default="mlp", metadata={"choices": MODELS})
    steps: int = field(default=3, metadata={"bounds": {"ge": 1, "fix": "at least one step"}})
    batch_size: int = field(
        default=32, metadata={"bounds": {"ge": 1, "fix": "e.g. --batch-size 32"}}
    )
    lr: float = field(
        default=0.05,
        metadata={
            "fix": "a positive learning rate, e.g. 0.05",
            "bounds": {"gt": 0, "fix": "a positive learning rate, e.g. 0.05"},
        },
    )
    dtype: str = field(default="float32", metadata={"choices": tuple(DTYPES)})
    seed: int = field(default=0, metadata={"bounds": {"ge": 0, "fix": "a seed >= 0"}})
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference or your phase2_advanced templates"},
    )


def build_model(name: str, spec: PatternSpec) -> nn.Sequential:
    if name == "cnn":
        return BabyCNN(in_channels=1, num_classes=spec.num_classes)
    return MLP(spec.image_size * spec.image_size, hidden=64, num_classes=spec.num_classes)


def validate_config(config: DemoConfig, world_size: int) -> None:
    """Every problem at once, naming the flags: refused before any process group exists."""
    problems = []
    if config.model not in MODELS:
        problems.append(f"--model {config.model!r} is unknown: choose one of {', '.join(MODELS)}")
    if config.dtype not in DTYPES:
        problems.append(f"--dtype {config.dtype!r} is unknown: choose one of {', '.join(DTYPES)}")
    problems += bound_problems(config)
    if config.model in MODELS:
        layers = len(build_model(config.model, PatternSpec()))
        if world_size > layers:
            problems.append(
                f"cannot split {layers} layers over {world_size} ranks: --model {config.model} "
                f"has {layers} layers and every rank needs at least one; run at most {layers} "
                f"processes (--nproc_per_node={layers})"
            )
    if problems:
        raise ValueError("; ".join(problems))


def _max_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


@dataclass
class StepReport:
    """One demo step: the model-parallel loss beside the single-device one, and the traffic."""

    loss: float
    reference_loss: float
    max_grad_diff: float  # over every parameter of every rank
    bytes_sent_per_rank: list[int]


def run_demo(config: DemoConfig) -> list[StepReport]:
    """Train a few steps model-parallel and, beside it, the same model on one device.

    Every rank also runs the single-device model (it is small), so each can compare its own
    stage's gradients with the matching ones by name. Every rank returns the same reports.
    """
    mp = load_impl(PHASE, "model_parallel", config.impl)
    info = current_info()
    validate_config(config, info.world_size)
    spec = PatternSpec()
    dtype = DTYPES[config.dtype]
    seed_everything(config.seed)
    model = build_model(config.model, spec).to(device=info.device, dtype=dtype)
    reference = copy.deepcopy(model)
    stage = mp.ModelParallelStage(model)
    sizes = mp.split_sizes(len(model), info.world_size)
    layout = ", ".join(
        f"rank {r}: layers {sum(sizes[:r])}-{sum(sizes[: r + 1]) - 1}" for r in range(len(sizes))
    )
    log0(
        f"naive model parallel ({config.impl}): world {info.world_size}, backend {info.backend}, "
        f"model {config.model} ({len(model)} layers), {config.dtype}; {layout}"
    )
    parameters = list(stage.parameters())  # a stage of ReLU/pooling layers has none
    optimizer = torch.optim.SGD(parameters, lr=config.lr) if parameters else None
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=config.lr)
    loss_fn = nn.CrossEntropyLoss()
    data = make_pattern_dataset(config.steps * config.batch_size, spec, split_seed=0)
    images, labels = data.tensors
    last = info.world_size - 1
    reports = []
    for step in range(config.steps):
        batch = slice(step * config.batch_size, (step + 1) * config.batch_size)
        inputs = images[batch].to(device=info.device, dtype=dtype)
        targets = labels[batch].to(info.device)
        stage.zero_grad(set_to_none=True)
        with CommCounter() as comm:
            loss = mp.forward_backward(stage, inputs, targets, loss_fn)
        loss_value = torch.zeros((), dtype=dtype, device=info.device) if loss is None else loss
        dist.broadcast(loss_value, src=last)
        ref_optimizer.zero_grad(set_to_none=True)
        ref_loss = loss_fn(reference(inputs), targets)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
        grad_diffs = [
            float((param.grad - ref_grads[name]).abs().max())
            for name, param in stage.named_parameters_in_model()
            if param.grad is not None
        ]
        grad_diff = _max_over_ranks(max(grad_diffs, default=0.0), info.device)
        sent = torch.tensor([comm.bytes_sent], dtype=torch.float64, device=info.device)
        per_rank = [torch.zeros_like(sent) for _ in range(info.world_size)]
        dist.all_gather(per_rank, sent)
        report = StepReport(
            loss_value.item(), ref_loss.item(), grad_diff, [int(t.item()) for t in per_rank]
        )
        log0(
            f"step {step + 1}/{config.steps}  loss {report.loss:.6f}  single device "
            f"{report.reference_loss:.6f}  |loss diff| "
            f"{abs(report.loss - report.reference_loss):.1e}  max |grad diff| "
            f"{report.max_grad_diff:.1e}  bytes sent per rank {report.bytes_sent_per_rank} "
            "(activations forward, gradients backward)"
        )
        if optimizer is not None:
            optimizer.step()
        ref_optimizer.step()
        reports.append(report)
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(DemoConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate_config(config, world))) is not None:
        return code
    with distributed_session():
        run_demo(config)
    return 0


if __name__ == "__main__":
    run_main(main)
