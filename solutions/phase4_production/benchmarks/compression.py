"""Benchmark the compression hooks of exercise 4.4: bytes, step time and accuracy, against none.

The ranks (2 by default) train the same MLP on the built-in dataset for a fixed number of epochs,
once per method, under torch's ``DistributedDataParallel`` with the method's communication hook
from :func:`compression.make_comm_hook`: none (torch's own all-reduce), fp16, top-k (1%) and
PowerSGD of rank 1, 2 and 4. Top-k and PowerSGD start after ``--start-iter`` plain steps. Per
method, the table shows:

* **bytes/step/rank**: what one rank hands to collectives in a compressed step (counted with
  CommCounter on a step after ``--start-iter``: an all-reduce's tensor, a rank's own part of an
  all-gather); for "none", the gradient buckets torch's Reducer all-reduces (its C++ calls are
  invisible to CommCounter; a bucket is exactly the gradients);
* **on the wire (ring)**: what a rank sends over the network for that payload with ring
  algorithms: 2(N-1)/N of an all-reduce's tensor, (N-1) x its part of an all-gather (a rank
  passes on every other rank's part); top-k's all-gather grows with N, an all-reduce does not;
* **step ms**: median over the compressed steps of the slowest rank's step (zero_grad, forward,
  backward with the hook, SGD step);
* **test acc**: accuracy on the held-out split after the last epoch.

    uv run python -m solutions.phase4_production.benchmarks.compression
    uv run python -m solutions.phase4_production.benchmarks.compression --epochs 8 --world 4
    uv run python -m solutions.phase4_production.benchmarks.compression --impl templates
"""

import contextlib
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from course.cli import benchmark_main, run_main
from course.comm_counter import CommCounter, CommRecord
from course.datasets import PatternSpec, make_pattern_dataset
from course.impl import IMPLS, load_impl
from course.models import MLP, BabyCNN
from course.results import Table, write_results
from course.training import StepOutput, TrainingLoop, check_global_batch, evaluate
from course.world import run_world

PHASE = "phase4_production"
# (row label, make_comm_hook name, its keyword arguments)
METHODS: list[tuple[str, str, dict[str, Any]]] = [
    ("none", "none", {}),
    ("fp16", "fp16", {}),
    ("top-k 1%", "topk", {"topk_ratio": 0.01}),
    ("PowerSGD r=1", "powersgd", {"powersgd_rank": 1}),
    ("PowerSGD r=2", "powersgd", {"powersgd_rank": 2}),
    ("PowerSGD r=4", "powersgd", {"powersgd_rank": 4}),
]
MARGIN = 2.0  # accuracy points: PowerSGD rank >= 2 should stay this close to "none"


@dataclass
class BenchmarkConfig:
    """The benchmark's flags."""

    world: int = field(default=2, metadata={"help": "number of ranks"})
    epochs: int = field(default=8, metadata={"help": "epochs per method"})
    model: str = field(
        default="mlp", metadata={"choices": ("mlp", "cnn"), "help": "MLP or BabyCNN"}
    )
    hidden: int = field(default=256, metadata={"help": "width of the MLP's two hidden layers"})
    global_batch_size: int = field(default=64, metadata={"help": "samples per step, all ranks"})
    lr: float = field(default=0.02, metadata={"gt": 0, "fix": "a positive learning rate"})
    momentum: float = field(default=0.9, metadata={"ge": 0, "lt": 1})
    train_samples: int = 4096
    test_samples: int = 1024
    start_iter: int = field(default=10, metadata={"help": "plain all-reduce steps first (>= 2)"})
    seed: int = 0
    record: str = field(
        default="", metadata={"help": "write the table to this results file (course/results.py)"}
    )
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference hooks or your templates"},
    )


@dataclass
class MethodResult:
    """One row of the table (every rank returns the same numbers)."""

    label: str
    payload: int  # bytes handed to collectives per compressed step, one rank
    wire: float  # bytes a rank sends on a ring for that payload
    step_seconds: float
    accuracy: float
    loss: float


def validate(config: BenchmarkConfig) -> None:
    """A ValueError naming every bad flag, before any process starts."""
    problems = [
        f"--{name.replace('_', '-')} {getattr(config, name)} must be >= {low}"
        for name, low in (
            ("world", 2),
            ("epochs", 1),
            ("hidden", 1),
            ("train_samples", 1),
            ("test_samples", 1),
            ("start_iter", 2),
        )
        if getattr(config, name) < low
    ]
    try:
        per_rank = check_global_batch(config.global_batch_size, config.world)
    except ValueError as err:
        problems.append(f"--global-batch-size: {err}")
    else:
        steps = config.epochs * (config.train_samples // config.global_batch_size)
        if steps < config.start_iter + 2:
            problems.append(
                f"{config.epochs} epoch(s) of {config.train_samples} samples are {steps} steps of "
                f"{per_rank * config.world} samples, fewer than --start-iter + 2 = "
                f"{config.start_iter + 2}: nothing compressed would be timed; train longer or "
                "lower --start-iter"
            )
    if problems:
        raise ValueError("; ".join(problems))


def make_model(config: BenchmarkConfig) -> nn.Module:
    torch.manual_seed(config.seed)
    if config.model == "cnn":
        return BabyCNN()
    image = PatternSpec().image_size
    return MLP(image * image, hidden=config.hidden, num_classes=10, depth=2)


def payload_bytes(records: Sequence[CommRecord], world_size: int) -> int:
    """Bytes a rank hands to collectives (CommCounter records an all-gather's whole output)."""
    gathers = ("all_gather", "all_gather_into_tensor")
    return sum(r.nbytes // world_size if r.op in gathers else r.nbytes for r in records)


def ring_bytes(records: Sequence[CommRecord], world_size: int) -> float:
    """Bytes a rank sends with ring algorithms: 2(N-1)/N of an all-reduce, (N-1) x its part of
    an all-gather."""
    total = 0.0
    for r in records:
        if r.op in ("all_gather", "all_gather_into_tensor"):
            total += (world_size - 1) * r.nbytes / world_size
        elif r.op == "all_reduce":
            total += 2 * (world_size - 1) / world_size * r.nbytes
    return total


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def train_one(
    config: BenchmarkConfig, label: str, name: str, options: dict[str, Any]
) -> MethodResult:
    """Train a fresh model with one method; runs on every rank."""
    compression = load_impl(PHASE, "compression", config.impl)
    world_size = dist.get_world_size()
    per_rank = check_global_batch(config.global_batch_size, world_size)
    spec = PatternSpec()
    train_set = make_pattern_dataset(config.train_samples, spec, split_seed=0)
    test_set = make_pattern_dataset(config.test_samples, spec, split_seed=1)
    module = make_model(config)
    model = DistributedDataParallel(module)
    hook = compression.make_comm_hook(
        name, start_iter=config.start_iter, seed=config.seed, **options
    )
    if hook is not None:
        model.register_comm_hook(*hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    sampler: DistributedSampler[int] = DistributedSampler(train_set, seed=config.seed)
    loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler, drop_last=True)
    counted_step = config.start_iter + 1  # a compressed step (the hooks count from 0)
    seconds: list[float] = []
    comm = CommCounter()

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        index = loop.global_step
        dist.barrier()
        started = time.perf_counter()
        with comm if index == counted_step else contextlib.nullcontext():
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
        elapsed = slowest(time.perf_counter() - started)
        if index >= config.start_iter and index != counted_step:
            seconds.append(elapsed)
        return StepOutput(float(loss.detach()), targets.shape[0])

    loop = TrainingLoop(model, optimizer, loader, device=torch.device("cpu"), step=step)
    results = loop.fit(config.epochs)
    accuracy = evaluate(module, test_set, torch.device("cpu"))
    if hook is None:  # torch's Reducer all-reduces the gradients in C++: count the buckets
        payload = sum(p.numel() * p.element_size() for p in module.parameters())
        wire = 2 * (world_size - 1) / world_size * payload
    else:
        payload = payload_bytes(comm.records, world_size)
        wire = ring_bytes(comm.records, world_size)
    return MethodResult(
        label, payload, wire, statistics.median(seconds), accuracy, results[-1].loss
    )


def measure_worker(config: BenchmarkConfig) -> list[MethodResult]:
    torch.set_num_threads(1)
    return [train_one(config, label, name, options) for label, name, options in METHODS]


def run(config: BenchmarkConfig) -> list[MethodResult]:
    """Every method, trained in one world of ``config.world`` ranks; rank 0's results."""
    validate(config)
    result: list[MethodResult] = run_world(
        measure_worker, config.world, (config,), {}, timeout=900
    )[0]
    return result


def setup_line(results: Sequence[MethodResult], config: BenchmarkConfig) -> str:
    base = next(r for r in results if r.label == "none")
    params = base.payload // 4
    name = "BabyCNN" if config.model == "cnn" else f"MLP 256-{config.hidden}-{config.hidden}-10"
    return (
        f"{name} ({params} parameters, fp32), {config.world} ranks (gloo, CPU), torch's DDP "
        f"(default buckets), global batch {config.global_batch_size}, "
        f"{config.epochs} epochs of {config.train_samples} samples, SGD lr {config.lr} momentum "
        f"{config.momentum}; compression from step {config.start_iter}; step time: median "
        "of the compressed steps (slowest rank)"
    )


def methods_table(results: Sequence[MethodResult]) -> Table:
    base = next(r for r in results if r.label == "none")
    table = Table(
        ["method", "bytes/step/rank", "vs none", "on the wire (ring)", "step ms", "vs none",
         "test acc", "vs none (points)", "last epoch loss"]
    )  # fmt: skip
    for r in results:
        table.add(
            r.label, r.payload, f"{base.payload / r.payload:.1f}x smaller", f"{r.wire:.0f}",
            f"{1e3 * r.step_seconds:.2f}", f"{r.step_seconds / base.step_seconds:.2f}x",
            f"{100 * r.accuracy:.1f}%", f"{100 * (r.accuracy - base.accuracy):+.1f}",
            f"{r.loss:.4f}",
        )  # fmt: skip
    return table


def summary_values(results: Sequence[MethodResult]) -> dict[str, str]:
    """The run's conclusions, computed: the accuracy margin, and the step-time ratios."""
    base = next(r for r in results if r.label == "none")
    by = {r.label: r for r in results}
    close = [
        label for label in ("PowerSGD r=2", "PowerSGD r=4")
        if 100 * (base.accuracy - by[label].accuracy) <= MARGIN
    ]  # fmt: skip
    heavy = [by[label].step_seconds / base.step_seconds for label in by if label[0] in "tP"]
    points = {
        label: f"{100 * (by[label].accuracy - base.accuracy):+.1f}"
        for label in ("PowerSGD r=2", "PowerSGD r=4")
    }
    return {
        "margin": "holds" if len(close) == 2 else "does NOT hold",
        "margin_points": f"{points['PowerSGD r=2']} and {points['PowerSGD r=4']} points",
        "heavy_step_ratio": f"{min(heavy):.2f}-{max(heavy):.2f}x",
        "fp16_step_ratio": f"{by['fp16'].step_seconds / base.step_seconds:.2f}x",
        "none_loss": f"{base.loss:.4f}",
        "compressed_loss": f"{min(r.loss for r in results if r is not base):.4f}-"
        f"{max(r.loss for r in results if r is not base):.4f}",
    }


def format_table(results: Sequence[MethodResult], config: BenchmarkConfig) -> str:
    values = summary_values(results)
    table = methods_table(results)
    lines = [
        setup_line(results, config),
        "",
        table.to_markdown(),
        "",
        f"Margin: PowerSGD rank >= 2 within {MARGIN:g} accuracy points of none: "
        f"{values['margin']}.",
    ]
    if config.record:
        table.note = setup_line(results, config)
        path = write_results(config.record, tables={"methods": table}, values=values)
        lines.append(f"recorded: {path}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- bytes per step
# (tests/benches/bench_4_4_compression.py: the learner's hooks against the formulas, in one run
# with torch's own fp16 hook and with no compression)

BYTES_METHODS: list[tuple[str, str, dict[str, Any]]] = [
    ("none (torch's all-reduce)", "none", {}),
    ("torch fp16_compress_hook", "torch-fp16", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("top-k 1%", "topk", {"topk_ratio": 0.01}),
    ("PowerSGD r=1", "powersgd", {"powersgd_rank": 1}),
    ("PowerSGD r=2", "powersgd", {"powersgd_rank": 2}),
]
BYTES_START_ITER = 2  # compressed from step 2; the bucket rebuild happens after step 0


def formula_bytes(name: str, options: dict[str, Any], buckets: Sequence[Sequence[Any]]) -> int:
    """What one rank must hand to collectives per step for ``buckets`` (each a list of gradient
    shapes), by the guide's formulas: 16 bits per element (fp16, bf16), k float32 values + k
    int64 indices with k = ceil(ratio x bucket elements) (top-k), the factors P (n x r) and Q
    (m x r) of each matrix worth compressing (torch's rule) plus every other element as it is
    (PowerSGD), 4 bytes per element (none)."""
    total = 0
    for shapes in buckets:
        numel = sum(math.prod(shape) for shape in shapes)
        if name in ("fp16", "bf16", "torch-fp16"):
            total += 2 * numel
        elif name == "topk":
            total += 12 * max(1, math.ceil(options["topk_ratio"] * numel))
        elif name == "powersgd":
            for shape in shapes:
                n, m = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
                r = min(n, m, options["powersgd_rank"])
                total += 4 * ((n + m) * r if (n + m) * r * 2.0 < n * m else n * m)
        else:
            total += 4 * numel
    return total


def recording(hook: Any, buckets: list[list[tuple[int, ...]]]) -> Any:
    """``hook``, noting the shapes of every bucket it is given (torch's DDP wants the second
    parameter named ``bucket`` and no string annotations)."""

    def hook_noting_buckets(state, bucket):
        buckets.append([tuple(g.shape) for g in bucket.gradients()])
        return hook(state, bucket)

    return hook_noting_buckets


def bytes_worker(impl: str) -> list[dict[str, Any]]:
    """Every method of :data:`BYTES_METHODS` on the benchmark's MLP under torch's DDP: the bytes
    a rank handed to collectives in one compressed step, the buckets' shapes, the formula."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.set_num_threads(1)
    compression = load_impl(PHASE, "compression", impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = []
    for label, name, options in BYTES_METHODS:
        module = make_model(BenchmarkConfig())
        model = DistributedDataParallel(module)
        made = (
            (None, default_hooks.fp16_compress_hook)
            if name == "torch-fp16"
            else compression.make_comm_hook(name, start_iter=BYTES_START_ITER, seed=0, **options)
        )
        buckets: list[list[tuple[int, ...]]] = []
        if made is not None:
            model.register_comm_hook(made[0], recording(made[1], buckets))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        comm = CommCounter()
        counted = BYTES_START_ITER + 1
        for step in range(counted + 1):
            x, y = torch.randn(16, 256, generator=g), torch.randint(0, 10, (16,), generator=g)
            buckets.clear()
            with comm if step == counted else contextlib.nullcontext():
                optimizer.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
        if made is None:  # torch's Reducer all-reduces in C++: the buckets are the gradients
            shapes = [[tuple(p.shape) for p in module.parameters()]]
            measured = sum(p.numel() * p.element_size() for p in module.parameters())
        else:
            shapes, measured = list(buckets), payload_bytes(comm.records, world_size)
        rows.append(
            {
                "label": label,
                "name": name,
                "measured": measured,
                "formula": formula_bytes(name, options, shapes),
                "buckets": len(shapes),
            }
        )
    return rows


def measure(config: BenchmarkConfig) -> Any:
    return run(config)


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(
        BenchmarkConfig, argv, __doc__, validate=validate, measure=measure, report=format_table
    )


if __name__ == "__main__":
    run_main(main)
