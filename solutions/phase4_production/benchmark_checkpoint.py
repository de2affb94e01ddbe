"""How long training is blocked per checkpoint: atomic torch.save, DCP save, DCP async_save.

A synchronous save blocks the training loop for the whole write (serialise, write, fsync). With
``dcp.async_save`` the loop is blocked only while the state is *staged* (copied into a buffer
training will not modify) and, at the next save, if the previous write is still running; the
write itself overlaps the training steps in between (torch/distributed/checkpoint/
state_dict_saver.py). The goal of issue 12: async blocks <= 0.1x of sync.

    uv run python -m solutions.phase4_production.benchmark_checkpoint
    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase4_production.benchmark_checkpoint --layers 2

Each rank holds the whole model (data parallel); DCP deduplicates replicated tensors and writes
each once, the atomic ``torch.save`` writes from rank 0 only. ``--impl templates`` times your
own checkpoint.py. The table is printed by rank 0; times are medians over ``--saves`` saves,
with ``--steps`` training steps between saves.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from course.cli import parse_config, run_main
from course.distributed import distributed_session
from course.impl import IMPLS, load_impl
from course.rank_logging import log0
from solutions.phase4_production.sharded_checkpoint import writer_group

PHASE = "phase4_production"


@dataclass
class BenchConfig:
    width: int = field(default=4096, metadata={"help": "width of each square Linear"})
    layers: int = field(default=4, metadata={"help": "Linear layers (4 x 4096^2 fp32 = 268 MB)"})
    saves: int = 3
    steps: int = field(default=4, metadata={"help": "training steps between two saves"})
    directory: str = field(default="", metadata={"help": "where to write (default: a temp dir)"})
    impl: str = field(default="solutions", metadata={"choices": IMPLS})


@dataclass
class Row:
    mode: str
    blocked: list[float]
    total: float

    @property
    def median(self) -> float:
        return statistics.median(self.blocked)


def build(
    config: BenchConfig, device: torch.device | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(config.width, config.width) for _ in range(config.layers)])
    model = model.to(device or torch.device("cpu"))
    return model, torch.optim.SGD(model.parameters(), lr=1e-6)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    first = model[0]  # type: ignore[index]
    x = torch.randn(4, first.in_features, device=first.weight.device)
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def measure(
    name: str,
    config: BenchConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    save: Callable[[int], Future[Any] | None],
) -> Row:
    """``save(i)`` blocks for the returned time; a returned future is waited on before the next
    save (that wait counts as blocked too) and at the end (that one is not: training is over)."""
    blocked: list[float] = []
    pending: Future[Any] | None = None
    started = time.perf_counter()
    for i in range(config.saves):
        train(model, optimizer, config.steps)
        dist.barrier()
        t0 = time.perf_counter()
        if pending is not None:
            pending.result()
        pending = save(i)
        blocked.append(time.perf_counter() - t0)
    if pending is not None:
        pending.result()
    dist.barrier()
    return Row(name, blocked, time.perf_counter() - started)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(BenchConfig, argv, __doc__)
    ckpt = load_impl(PHASE, "checkpoint", config.impl)
    with distributed_session() as info:
        model, optimizer = build(config, info.device)
        size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        root = Path(config.directory or tempfile.mkdtemp(prefix="dtfs-bench-ckpt-"))
        if info.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        manager = ckpt.CheckpointManager(root / "atomic", keep=2, log=lambda _m: None)
        # the background writes run DCP's planning collectives: on the training's group they
        # would interleave with the training's own collectives (a deadlock): their own group
        writer = writer_group()
        train(model, optimizer, 1)  # warm up allocator and kernels

        def atomic(i: int) -> None:
            if info.rank == 0:
                manager.save(i, {"model.pt": model.state_dict()})
            dist.barrier()

        def dcp_sync(i: int) -> None:
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / f"dcp_{i}"))

        def dcp_async(i: int) -> Future[Any]:
            future = dcp.async_save(
                {"model": model.state_dict()},
                checkpoint_id=str(root / f"async_{i}"),
                process_group=writer,
            )
            return future  # type: ignore[return-value]

        stager = DefaultStager(StagingOptions(False, False, False, False))

        def dcp_async_reused(i: int) -> Future[Any]:
            future = dcp.async_save(
                {"model": model.state_dict()},
                checkpoint_id=str(root / f"async_reused_{i}"),
                async_stager=stager,
                process_group=writer,
            )
            return future  # type: ignore[return-value]

        rows = [
            measure("atomic torch.save + sha256 (rank 0)", config, model, optimizer, atomic),
            measure("dcp.save", config, model, optimizer, dcp_sync),
            measure("dcp.async_save", config, model, optimizer, dcp_async),
            measure("dcp.async_save, one stager", config, model, optimizer, dcp_async_reused),
        ]
        stager.close()
        t0 = time.perf_counter()
        train(model, optimizer, config.steps)
        step_s = (time.perf_counter() - t0) / config.steps
        reference = rows[1].median
        log0(
            f"model {size_mb:.0f} MB, world {info.world_size}, {config.saves} saves, "
            f"{config.steps} steps of {step_s * 1e3:.0f} ms between saves"
        )
        log0(f"{'mode':<38} {'blocked/ckpt (median)':>22} {'MB/s':>8} {'vs dcp.save':>12}")
        for row in rows:
            log0(
                f"{row.mode:<38} {row.median:>20.3f} s {size_mb / row.median:>8.0f} "
                f"{row.median / reference:>11.3f}x"
            )
        dist.barrier()
        if info.rank == 0 and not config.directory:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    run_main(main)
