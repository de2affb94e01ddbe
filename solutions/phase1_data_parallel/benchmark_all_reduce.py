"""Benchmark the hand-made all-reduces beside ``dist.all_reduce``.

For each world size and message size, every strategy runs a few timed iterations; an iteration's
time is the slowest rank's (all ranks start together after a barrier), and the table shows the
median. Bandwidths use the nccl-tests definitions (nccl-tests, doc/PERFORMANCE.md):

* algbw = S / t: bytes of the tensor over time, what the caller sees;
* busbw = algbw · 2(n-1)/n: for all-reduce, the traffic each link must carry in the optimal
  algorithm, so numbers are comparable across world sizes and against the hardware's peak.

    uv run python -m solutions.phase1_data_parallel.benchmark_all_reduce
    uv run python -m solutions.phase1_data_parallel.benchmark_all_reduce --worlds 2 --max-mib 4
    uv run python -m solutions.phase1_data_parallel.benchmark_all_reduce \
        --strategies dist.all_reduce,direct_exchange
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from course.cli import parse_config, run_main
from course.distributed import current_info
from course.world import run_world
from solutions.phase1_data_parallel.all_reduce import (
    direct_exchange_all_reduce,
    reduce_broadcast_all_reduce,
)

STRATEGIES: dict[str, Callable[[torch.Tensor], Any]] = {
    "dist.all_reduce": dist.all_reduce,
    "reduce_broadcast": reduce_broadcast_all_reduce,
    "direct_exchange": direct_exchange_all_reduce,
}
KIB = 1024


@dataclass(frozen=True)
class Measurement:
    world_size: int
    nbytes: int
    strategy: str
    median_seconds: float

    @property
    def algbw(self) -> float:
        """Bytes per second as the caller sees it (nccl-tests' algbw)."""
        return self.nbytes / self.median_seconds

    @property
    def busbw(self) -> float:
        return bus_bandwidth(self.algbw, self.world_size)


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw · 2(n-1)/n."""
    return algbw * 2 * (world_size - 1) / world_size


def default_sizes(max_bytes: int) -> list[int]:
    """1 KiB, 4 KiB, 16 KiB, ... up to ``max_bytes`` (powers of four)."""
    sizes, size = [], KIB
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def _iterations_for(nbytes: int, world_size: int) -> int:
    """Fewer repeats for big messages so the whole table stays within a couple of minutes."""
    traffic = nbytes * world_size
    if traffic >= 64 * 2**20:
        return 3
    if traffic >= 4 * 2**20:
        return 5
    return 15


def measure_worker(sizes: Sequence[int], strategies: Sequence[str]) -> list[Measurement]:
    """Runs on every rank; returns rank 0's measurements (others return an empty list)."""
    info = current_info()
    results = []
    for nbytes in sizes:
        numel = max(1, nbytes // 4)
        tensor = torch.ones(numel, dtype=torch.float32, device=info.device)
        for name in strategies:
            fn = STRATEGIES[name]
            fn(tensor)  # warm-up: connections, allocations
            times = []
            for _ in range(_iterations_for(nbytes, info.world_size)):
                dist.barrier()
                if info.device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                fn(tensor)
                if info.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = torch.tensor(
                    [time.perf_counter() - start], dtype=torch.float64, device=info.device
                )
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times.append(elapsed.item())
            results.append(Measurement(info.world_size, numel * 4, name, statistics.median(times)))
    return results if info.rank == 0 else []


def _human_bytes(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", KIB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def format_table(measurements: Sequence[Measurement]) -> str:
    """A markdown table: one row per (world, size, strategy), ratio = time / dist.all_reduce's."""
    reference = {
        (m.world_size, m.nbytes): m.median_seconds
        for m in measurements
        if m.strategy == "dist.all_reduce"
    }
    lines = [
        "| world | size | strategy | median ms | algbw GB/s | busbw GB/s "
        "| time vs dist.all_reduce |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for m in measurements:
        ref = reference.get((m.world_size, m.nbytes))
        ratio = f"{m.median_seconds / ref:.2f}x" if ref else "-"
        lines.append(
            f"| {m.world_size} | {_human_bytes(m.nbytes)} | {m.strategy} | "
            f"{1e3 * m.median_seconds:.3f} | {m.algbw / 1e9:.3f} | {m.busbw / 1e9:.3f} | {ratio} |"
        )
    return "\n".join(lines)


def run_benchmark(
    worlds: Sequence[int], sizes: Sequence[int], strategies: Sequence[str]
) -> list[Measurement]:
    unknown = [name for name in strategies if name not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}: choose from {', '.join(STRATEGIES)}")
    if any(world < 2 for world in worlds):
        raise ValueError(f"worlds {list(worlds)}: an all-reduce needs at least 2 ranks")
    measurements: list[Measurement] = []
    for world in worlds:
        per_rank = run_world(measure_worker, world, (list(sizes), list(strategies)), timeout=900)
        measurements += per_rank[0]
    return measurements


@dataclass
class BenchmarkConfig:
    """The benchmark's flags (``--worlds``, ``--max-mib``, ``--strategies``)."""

    worlds: str = field(default="2,4", metadata={"help": "world sizes, comma-separated"})
    max_mib: float = field(default=64.0, metadata={"help": "largest message, MiB"})
    strategies: str = field(
        default=",".join(STRATEGIES),
        metadata={"help": f"comma-separated, from {', '.join(STRATEGIES)}"},
    )


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(BenchmarkConfig, argv, __doc__)
    try:
        worlds = [int(world) for world in _split(config.worlds)]
    except ValueError:
        print(f"error: --worlds {config.worlds!r}: give world sizes like 2,4", file=sys.stderr)
        return 2
    sizes = default_sizes(int(config.max_mib * 2**20))
    started = time.perf_counter()
    try:
        measurements = run_benchmark(worlds, sizes, _split(config.strategies))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(measurements))
    print(f"\n({time.perf_counter() - started:.0f} s; torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    run_main(main)
