"""Demo of exercise 4.5: train with one rank slowed on purpose, and find it.

Trains ``BabyCNN`` on the built-in data through the course's training loop, gradients averaged by
an explicit all-reduce after backward (the ``sync`` section), with :class:`TrainingMonitor`
attached. ``--slow-rank R`` makes rank R sleep ``--slow-ms`` in every forward (a slow GPU, a noisy
neighbour). Every ``--every-n-steps`` steps the monitor names the stragglers; at the end rank 0
prints the per-rank breakdown of the whole run and plots it. Files go to ``--output-dir``:
``metrics.jsonl``, ``tensorboard/`` (``uv run tensorboard --logdir runs/monitoring``),
``breakdown.png`` and, with ``--profile``, ``trace_rank<r>.json`` (chrome://tracing, Perfetto).

    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase4_production.demos.monitoring --slow-rank 1
    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase4_production.demos.monitoring --slow-rank 1 --impl templates
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from course.cli import parse_config, refuse_before_start, run_main
from course.datasets import PatternSpec, make_pattern_dataset
from course.distributed import distributed_session
from course.impl import IMPLS, load_impl
from course.models import BabyCNN
from course.rank_logging import log0
from course.results import Table, command_line, write_results
from course.seeding import seed_everything
from course.training import SECTIONS, TrainingLoop, check_global_batch
from phase4_production.checkpoint_files import folder_problem
from phase4_production.device_peaks import peak_flops_per_second
from phase4_production.training_monitor import TrainingMonitor, breakdown_table
from solutions.phase1_data_parallel.trainer import average_gradients

PHASE = "phase4_production"


@dataclass
class DemoConfig:
    """Flags of the demo; every rank must be given the same values."""

    epochs: int = 2
    global_batch_size: int = 64
    lr: float = field(default=0.05, metadata={"gt": 0, "fix": "a positive learning rate"})
    train_samples: int = 2048
    slow_rank: int = field(default=-1, metadata={"help": "the rank to slow down (-1: none)"})
    slow_ms: float = field(default=30.0, metadata={"help": "its extra sleep per forward, ms"})
    every_n_steps: int = field(default=8, metadata={"help": "report every N optimizer steps"})
    threshold: float = field(default=1.5, metadata={"help": "straggler: > threshold x median"})
    output_dir: str = field(default="runs/monitoring", metadata={"help": "where files go"})
    profile: bool = field(default=False, metadata={"help": "trace steps 3-4 with torch.profiler"})
    peak_tflops: float = field(
        default=0.0, metadata={"help": "the device's peak TFLOP/s for MFU (0: table or measured)"}
    )
    plot: bool = field(default=True, metadata={"help": "draw breakdown.png from the JSONL"})
    ddp: bool = field(
        default=False,
        metadata={"help": "torch's DDP instead of an all-reduce after backward (see the guide)"},
    )
    ddp_wait_in_backward: bool = field(
        default=True,
        metadata={"help": "with --ddp, leave backward (where DDP waits) out of the compared time"},
    )
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference or your phase 4 templates"},
    )
    record: str = field(
        default="", metadata={"help": "write the table to this results file (course/results.py)"}
    )


def validate(config: DemoConfig, world_size: int) -> None:
    """Every bad flag at once, naming each: raised before the process group exists."""
    problems = []
    for name in ("epochs", "train_samples", "every_n_steps"):
        if getattr(config, name) < 1:
            problems.append(f"--{name.replace('_', '-')} {getattr(config, name)} must be >= 1")
    if not -1 <= config.slow_rank < world_size:
        problems.append(
            f"--slow-rank {config.slow_rank} is not a rank of this world of {world_size}: "
            f"use 0..{world_size - 1}, or -1 for none"
        )
    if config.slow_ms < 0:
        problems.append(f"--slow-ms {config.slow_ms} must be >= 0")
    if config.threshold <= 1:
        problems.append(f"--threshold {config.threshold} must be > 1 (e.g. 1.5)")
    if config.peak_tflops < 0:
        problems.append(f"--peak-tflops {config.peak_tflops} must be > 0 (or 0: table/measured)")
    folder = folder_problem(config.output_dir, "--output-dir")
    if folder is not None:
        problems.append(folder)
    try:
        check_global_batch(config.global_batch_size, world_size)
    except ValueError as err:
        problems.append(f"--global-batch-size: {err}")
    if not problems and config.train_samples < config.global_batch_size:
        problems.append(
            f"--train-samples {config.train_samples} is less than one global batch "
            f"({config.global_batch_size})"
        )
    if problems:
        raise ValueError("; ".join(problems))


def slow_down(model: nn.Module, seconds: float) -> None:
    """Sleep ``seconds`` before every forward of ``model`` (this rank only)."""

    def sleep(_module: nn.Module, _inputs: Any) -> None:
        time.sleep(seconds)

    model.register_forward_pre_hook(sleep)


def breakdown_results_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`breakdown_table`'s rows as a results table."""
    table = Table(["rank", *(f"{s} ms" for s in SECTIONS), "step ms", "busy ms", "MFU",
                   "straggler"])  # fmt: skip
    for row in rows:
        mfu = "-" if row.get("mfu") is None else f"{100 * row['mfu']:.2f}%"
        table.add(
            row["rank"], *(f"{row[s]:.2f}" for s in SECTIONS), f"{row['step_ms']:.2f}",
            f"{row['busy_ms']:.2f}", mfu, "yes" if row.get("straggler") else "",
        )  # fmt: skip
    return table


def summary_values(
    rows: Sequence[dict[str, Any]], monitor: TrainingMonitor, reports: int, config: DemoConfig
) -> dict[str, str]:
    """What the guide says about a run, computed from it: who was named how often, the step
    time of every rank, how much longer the slow rank's forward was and how long the others
    waited."""
    named = sorted({s.rank for _, s in monitor.stragglers})
    counts = {r: sum(1 for _, s in monitor.stragglers if s.rank == r) for r in named}
    verdict = (
        "; ".join(f"rank {r} named in {counts[r]} of {reports} reports" for r in named)
        or f"nobody named in {reports} reports"
    )
    steps = [row["step_ms"] for row in rows]
    values = {
        "named": verdict,
        "step_ms": f"{min(steps):.1f}-{max(steps):.1f} ms",
        "busy_ms": ", ".join(f"rank {row['rank']} {row['busy_ms']:.1f} ms" for row in rows),
    }
    slow = [row for row in rows if row["rank"] == config.slow_rank]
    others = [row for row in rows if row["rank"] != config.slow_rank]
    if slow and others:
        gap = slow[0]["forward"] - max(row["forward"] for row in others)
        values["forward_gap_ms"] = f"{gap:.1f} ms"
        values["others_wait"] = ", ".join(
            f"rank {row['rank']} {row['sync'] + (row['backward'] if config.ddp else 0):.1f} ms"
            for row in others
        )
    return values


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(DemoConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate(config, world))) is not None:
        return code
    monitoring = load_impl(PHASE, "monitoring", config.impl)
    with distributed_session() as info:
        per_rank = config.global_batch_size // info.world_size
        seed_everything(0)  # the same initial weights on every rank
        model = BabyCNN().to(info.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
        train_set = make_pattern_dataset(config.train_samples, PatternSpec(), split_seed=0)
        sampler: DistributedSampler[int] = DistributedSampler(train_set, seed=0, drop_last=True)
        loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler, drop_last=True)
        x, y = next(iter(loader))
        x, y = x.to(info.device), y.to(info.device)
        flops = monitoring.count_training_flops(
            model, x, lambda out: nn.functional.cross_entropy(out, y)
        )
        override = config.peak_tflops * 1e12 if config.peak_tflops else None
        peak, source = peak_flops_per_second(info.device, override=override)
        shared = torch.tensor([peak], dtype=torch.float64, device=info.device)
        dist.broadcast(shared, src=0)  # one peak for all ranks: a measured one varies per rank
        peak = float(shared)
        header = (
            f"monitoring ({config.impl}), world {info.world_size}, {per_rank} samples per rank "
            f"per step: {flops / 1e6:.1f} MFLOP per step and rank (forward + backward, "
            f"FlopCounterMode); peak {peak / 1e9:.1f} GFLOP/s ({source})"
        )
        log0(header)
        if info.rank == config.slow_rank:
            slow_down(model, config.slow_ms / 1e3)
        trained: nn.Module = model
        wait_sections: tuple[str, ...] = ("sync",)
        if config.ddp:  # DDP all-reduces inside backward: a fast rank waits there
            trained = DistributedDataParallel(model)
            if config.ddp_wait_in_backward:
                wait_sections = ("sync", "backward")
            log0(f"torch DDP: sections compared between ranks leave out {', '.join(wait_sections)}")
        if config.slow_rank >= 0:
            log0(f"rank {config.slow_rank} sleeps {config.slow_ms:.0f} ms in every forward")
        steps_per_epoch = len(loader)
        total = steps_per_epoch * config.epochs
        profile = range(3, 5) if config.profile else None
        if info.rank == 0:  # the monitor appends (a resumed run continues its file): start afresh
            (Path(config.output_dir) / "metrics.jsonl").unlink(missing_ok=True)
        with TrainingMonitor(
            config.output_dir,
            every_n_steps=config.every_n_steps,
            straggler_threshold=config.threshold,
            wait_sections=wait_sections,
            flops_per_step=flops,
            peak_flops=peak,
            device=info.device,
            profile_steps=profile,
            progress_total=total,
            impl=config.impl,
        ) as monitor:
            loop = TrainingLoop(
                trained,
                optimizer,
                loader,
                device=info.device,
                sampler=sampler,
                sync_gradients=None if config.ddp else average_gradients,
                callbacks=[monitor],
            )
            for epoch in range(config.epochs):
                result = loop.run_epoch(epoch)
                log0(
                    f"epoch {epoch + 1}/{config.epochs}  loss {result.loss:.4f}  "
                    f"{result.totals['samples'] / result.seconds:8.0f} samples/s"
                )
            warmup = config.every_n_steps if loop.global_step > config.every_n_steps else 0
            rows = monitor.summary(skip_first=warmup)
        log0(
            f"\nper-rank breakdown, mean per step over steps {warmup + 1}-{loop.global_step}"
            + (f" (steps 1-{warmup}: warm-up)" if warmup else "")
            + ":\n"
        )
        log0(breakdown_table(rows))
        named = sorted({s.rank for _, s in monitor.stragglers})
        reports = loop.global_step // config.every_n_steps
        if named:
            for rank in named:
                times = sum(1 for _, s in monitor.stragglers if s.rank == rank)
                log0(f"\nstraggler: rank {rank}, named in {times} of {reports} reports")
        else:
            log0(f"\nno straggler named in {reports} reports")
        if config.record and info.rank == 0:
            values = summary_values(rows, monitor, reports, config)
            table = breakdown_results_table(rows)
            table.note = header
            path = write_results(
                config.record,
                tables={"breakdown": table},
                values=values,
                command=command_line(),
            )
            log0(f"recorded: {path}")
        if info.rank == 0:
            jsonl = Path(config.output_dir) / monitor.jsonl_name()
            log0(f"metrics: {jsonl}; TensorBoard: {Path(config.output_dir) / 'tensorboard'}")
            if config.plot and jsonl.is_file():
                from solutions.phase4_production.demos.plot_metrics import load_records, plot

                log0(f"plot: {plot(load_records(jsonl), jsonl.with_name('breakdown.png'))}")
    return 0


if __name__ == "__main__":
    run_main(main)
