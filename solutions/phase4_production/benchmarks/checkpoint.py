"""How long training is blocked per checkpoint: atomic torch.save, DCP save, DCP async_save.

A synchronous save blocks the training loop for the whole write (serialise, write, fsync). With
``dcp.async_save`` the loop is blocked only while the state is *staged* (copied into a buffer
training will not modify) and, at the next save, if the previous write is still running; the
write itself overlaps the training steps in between (torch/distributed/checkpoint/
state_dict_saver.py). The goal of issue 12: async blocks <= 0.1x of sync.

    uv run python -m solutions.phase4_production.benchmarks.checkpoint
    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase4_production.benchmarks.checkpoint --layers 2

Each rank holds the whole model (data parallel); DCP deduplicates replicated tensors and writes
each once, the atomic ``torch.save`` writes from rank 0 only. ``--impl templates`` times your
own checkpoint.py. The table is printed by rank 0; times are medians over ``--saves`` saves,
with ``--steps`` training steps between saves.
"""

from __future__ import annotations

import math
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

from course.cli import parse_config, refuse_before_start, run_main
from course.distributed import distributed_session
from course.impl import IMPLS, load_impl
from course.rank_logging import log0
from course.results import Table, command_line, write_results
from phase4_production.checkpoint_files import folder_problem, sha256_file
from solutions.phase4_production.library.sharded_checkpoint import writer_group

PHASE = "phase4_production"


@dataclass
class BenchConfig:
    width: int = field(default=4096, metadata={"ge": 1, "help": "width of each square Linear"})
    layers: int = field(
        default=4, metadata={"ge": 1, "help": "Linear layers (4 x 4096^2 fp32 = 268 MB)"}
    )
    saves: int = field(default=3, metadata={"ge": 1, "help": "saves per mode (the median)"})
    steps: int = field(default=4, metadata={"ge": 1, "help": "training steps between two saves"})
    directory: str = field(default="", metadata={"help": "where to write (default: a temp dir)"})
    impl: str = field(default="solutions", metadata={"choices": IMPLS})
    record: str = field(
        default="", metadata={"help": "write the table to this results file (course/results.py)"}
    )


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


def validate(config: BenchConfig) -> None:
    """Refused before any process group: a --directory that cannot hold checkpoints."""
    if config.directory:
        problem = folder_problem(config.directory, "--directory")
        if problem is not None:
            raise ValueError(problem)


GOAL_RATIO = 0.1  # async blocks at most this much of a synchronous dcp.save
MTBF_HOURS = 24.0  # the Young's-interval example: a day between failures


def blocked_table(rows: Sequence[Row]) -> Table:
    """Each mode's median blocked time per checkpoint, and against dcp.save."""
    reference = rows[1].median
    table = Table(["mode", "blocked per checkpoint", "vs dcp.save"])
    for row in rows:
        table.add(row.mode, f"{row.median:.3f} s", f"{row.median / reference:.3f}x")
    return table


def young(delta: float, mtbf: float) -> tuple[float, float]:
    """Young's interval sqrt(2 delta M) (seconds) and the fraction of time it loses,
    delta / tau + tau / (2 M) (J. W. Young, CACM 1974)."""
    tau = math.sqrt(2 * delta * mtbf)
    return tau, delta / tau + tau / (2 * mtbf)


def summary_values(rows: Sequence[Row], hashed: float, world: int) -> dict[str, str]:
    """What the guide quotes from a run: the goal's ratio and verdict, the sha256's share of the
    atomic save, Young's interval for the synchronous and the asynchronous save."""
    by = {row.mode: row.median for row in rows}
    sync, reused = by["dcp.save"], by["dcp.async_save, one stager"]
    ratio = reused / sync
    values = {
        "world": str(world),
        "atomic_s": f"{by['atomic torch.save + sha256 (rank 0)']:.3f} s",
        "dcp_s": f"{sync:.3f} s",
        "async_fresh_ratio": f"{by['dcp.async_save'] / sync:.3f}x",
        "async_reused_ratio": f"{ratio:.3f}x",
        "goal": f"{'met' if ratio <= GOAL_RATIO else 'not met'} ({ratio:.3f}x, goal <= "
        f"{GOAL_RATIO}x of dcp.save)",
        "sha256_s": f"{hashed:.2f} s",
    }
    for name, delta in (("sync", sync), ("async", reused)):
        tau, lost = young(delta, MTBF_HOURS * 3600)
        values[f"young_{name}_delta"] = f"{delta:.3f} s"
        values[f"young_{name}_tau"] = f"{tau / 60:.1f} min"
        values[f"young_{name}_lost"] = f"{100 * lost:.2f}%"
    return values


def sha256_seconds(folder: Path) -> float:
    """How long hashing the newest atomic checkpoint's file takes (part of every atomic save)."""
    newest = sorted(folder.glob("step_*/model.pt"))[-1]
    t0 = time.perf_counter()
    sha256_file(newest)
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(BenchConfig, argv, __doc__)
    if (code := refuse_before_start(lambda _world: validate(config))) is not None:
        return code
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
        hashed = sha256_seconds(root / "atomic") if info.rank == 0 else 0.0
        setup = (
            f"model {size_mb:.0f} MB, world {info.world_size}, {config.saves} saves, "
            f"{config.steps} steps of {step_s * 1e3:.0f} ms between saves"
        )
        table = blocked_table(rows)
        log0(setup)
        log0(table.to_markdown())
        if config.record and info.rank == 0:
            values = summary_values(rows, hashed, info.world_size)
            table.note = setup
            path = write_results(
                config.record, tables={"blocked": table}, values=values, command=command_line()
            )
            log0(f"recorded: {path}")
        dist.barrier()
        if info.rank == 0 and not config.directory:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    run_main(main)
