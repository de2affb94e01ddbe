"""Benchmark the memory/compute trade of phase 2, part 1: checkpointing, accumulation, bf16.

One deep MLP, one batch, one optimizer step per repetition. For each way of running it the
table shows the peak bytes autograd held for backward (``SavedTensorMeter``: works on CPU and
GPU) and the median step time, both as ratios to the plain fp32 step. On a GPU it adds
``torch.cuda.max_memory_allocated`` for the step (weights, gradients and optimizer state
included). ``--impl templates`` measures your own checkpointing (2.3) and accumulation (2.1).

    uv run python -m solutions.phase2_advanced.benchmarks.memory
    uv run python -m solutions.phase2_advanced.benchmarks.memory --depth 32 --width 1024 --batch 256
"""

from __future__ import annotations

import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from course.cli import parse_config, run_main
from course.impl import IMPLS, load_impl
from course.memory import SavedTensorMeter
from course.results import Table, write_results
from solutions.phase2_advanced.demos.checkpointing import deep_mlp

PHASE = "phase2_advanced"

StepFn = Callable[[nn.Sequential, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class Row:
    name: str
    peak_saved_bytes: int
    median_seconds: float
    cuda_peak_bytes: int | None


def plain(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(x), y).backward()


def checkpointed(segments: int, checkpointing: ModuleType) -> StepFn:
    """A step through ``checkpointing.checkpoint_sequential`` (the module chosen by --impl)."""

    def step(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> None:
        out = checkpointing.checkpoint_sequential(model, segments, x)
        nn.functional.cross_entropy(out, y).backward()

    return step


def accumulated(micro_batches: int, accumulation: ModuleType) -> StepFn:
    """A step through ``accumulation.accumulate_gradients`` (the module chosen by --impl)."""

    def step(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> None:
        size = math.ceil(len(x) / micro_batches)
        micro = accumulation.split_micro_batches(x, y, size)
        accumulation.accumulate_gradients(model, nn.functional.cross_entropy, micro)

    return step


def bf16_autocast(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> None:
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()


def measure(
    name: str,
    step: StepFn,
    model: nn.Sequential,
    x: torch.Tensor,
    y: torch.Tensor,
    repeats: int,
) -> Row:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    cuda = x.device.type == "cuda"
    times, peak, cuda_peak = [], 0, None
    for _ in range(repeats + 1):  # the first run warms up allocators and kernels
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with SavedTensorMeter(exclude=model.parameters()) as meter:
            step(model, x, y)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
            cuda_peak = torch.cuda.max_memory_allocated()
        times.append(time.perf_counter() - start)
        peak = meter.peak_bytes
    return Row(name, peak, statistics.median(times[1:]), cuda_peak)


def results_table(rows: Sequence[Row]) -> Table:
    """One row per run: peak saved bytes and median step time, each also as a ratio to plain."""
    base = rows[0]
    columns = ["run", "peak saved for backward MiB", "vs plain", "median step ms", "vs plain"]
    cuda = base.cuda_peak_bytes is not None
    if cuda:
        columns += ["cuda max allocated MiB", "vs plain"]
    table = Table(columns)
    for row in rows:
        cells = [
            row.name,
            f"{row.peak_saved_bytes / 2**20:.2f}",
            f"{row.peak_saved_bytes / base.peak_saved_bytes:.2f}x",
            f"{1e3 * row.median_seconds:.1f}",
            f"{row.median_seconds / base.median_seconds:.2f}x",
        ]
        if cuda and row.cuda_peak_bytes is not None and base.cuda_peak_bytes:
            cells += [
                f"{row.cuda_peak_bytes / 2**20:.1f}",
                f"{row.cuda_peak_bytes / base.cuda_peak_bytes:.2f}x",
            ]
        table.add(*cells)
    return table


def format_table(rows: Sequence[Row]) -> str:
    """The table as markdown, as printed."""
    return results_table(rows).to_markdown()


def slug(name: str) -> str:
    """A row's name as a results key: "checkpoint, 4 segments" -> "checkpoint_4_segments"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def summary(rows: Sequence[Row]) -> dict[str, str]:
    """The ratios the guide quotes, per row (``<slug>_saved``, ``<slug>_time``), the segment
    count with the smallest peak, and whether bf16 autocast was faster or slower than fp32."""
    base = rows[0]
    values: dict[str, str] = {}
    for row in rows:
        values[f"{slug(row.name)}_saved"] = f"{row.peak_saved_bytes / base.peak_saved_bytes:.2f}x"
        values[f"{slug(row.name)}_time"] = f"{row.median_seconds / base.median_seconds:.2f}x"
    checkpoints = [row for row in rows if row.name.startswith("checkpoint")]
    if checkpoints:
        best = min(checkpoints, key=lambda row: row.peak_saved_bytes)
        values["smallest_peak"] = best.name
    bf16 = next((row for row in rows if row.name == "bf16 autocast"), None)
    if bf16 is not None:
        ratio = bf16.median_seconds / base.median_seconds
        values["bf16_speed"] = (
            "slower than" if ratio > 1.05 else "faster than" if ratio < 0.95 else "as fast as"
        )
    return values


def run(
    depth: int,
    width: int,
    batch: int,
    repeats: int,
    device: torch.device,
    impl: str = "solutions",
) -> list[Row]:
    """One row per way of running the same step, the plain fp32 step first."""
    checkpointing = load_impl(PHASE, "activation_checkpointing", impl)
    accumulation = load_impl(PHASE, "gradient_accumulation", impl)
    torch.manual_seed(0)
    model = deep_mlp(depth, width, num_classes=10).to(device)
    x = torch.randn(batch, width, device=device)
    y = torch.randint(10, (batch,), device=device)
    # each Linear+ReLU block keeps one activation, so sqrt(depth) segments minimise the peak;
    # one block per segment (depth segments) keeps as much as no checkpointing at all
    runs: list[tuple[str, StepFn]] = [("plain fp32", plain)]
    for segments in sorted({2, max(2, math.isqrt(depth)), depth}):
        runs.append((f"checkpoint, {segments} segments", checkpointed(segments, checkpointing)))
    runs += [
        ("accumulation, 4 micro-batches", accumulated(4, accumulation)),
        ("bf16 autocast", bf16_autocast),
    ]
    return [measure(name, step, model, x, y, repeats) for name, step in runs]


@dataclass
class BenchmarkConfig:
    """Flags of the benchmark."""

    depth: int = field(default=16, metadata={"help": "Linear+ReLU blocks"})
    width: int = 512
    batch: int = 1024
    repeats: int = field(default=5, metadata={"help": "timed steps after one warm-up"})
    device: str = field(
        default="cuda" if torch.cuda.is_available() else "cpu",
        metadata={"help": "cpu, cuda or cuda:N"},
    )
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "measure the reference or your templates"},
    )
    record: str = field(
        default="", metadata={"help": "also write the table to this results file (JSON)"}
    )


def validate(config: BenchmarkConfig) -> None:
    """Every bad flag at once, naming each."""
    problems = [
        f"--{name} {getattr(config, name)} must be >= {low} (fix: e.g. --{name} {default})"
        for name, low, default in (
            ("depth", 2, 16),
            ("width", 1, 512),
            ("batch", 4, 1024),
            ("repeats", 1, 5),
        )
        if getattr(config, name) < low
    ]
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        problems.append(f"--device {config.device}: CUDA is not available here (use cpu)")
    if problems:
        raise ValueError("; ".join(problems))


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(BenchmarkConfig, argv, __doc__)
    try:
        validate(config)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if config.device == "cpu":
        torch.set_num_threads(1)
    device = torch.device(config.device)
    rows = run(config.depth, config.width, config.batch, config.repeats, device, config.impl)
    title = (
        f"deep MLP: {config.depth} x (Linear {config.width} + ReLU) + classifier, batch "
        f"{config.batch}, {config.device}, torch {torch.__version__}, {config.impl}"
    )
    table = results_table(rows)
    print(title)
    print(table.to_markdown())
    if config.record:
        table.note = title
        path = write_results(config.record, tables={"memory": table}, values=summary(rows))
        print(f"recorded {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
