"""Benchmark the hand-made all-reduces beside ``dist.all_reduce``.

For each world size and message size, every strategy runs a few timed iterations; an iteration's
time is the slowest rank's (all ranks start together after a barrier), and the table shows the
median. Bandwidths use the nccl-tests definitions (nccl-tests, doc/PERFORMANCE.md):

* algbw = S / t: bytes of the tensor over time, what the caller sees;
* busbw = algbw · 2(n-1)/n: for all-reduce, the traffic each link must carry in the optimal
  algorithm, so numbers are comparable across world sizes and against the hardware's peak.

    uv run python -m solutions.phase1_data_parallel.benchmarks.all_reduce
    uv run python -m solutions.phase1_data_parallel.benchmarks.all_reduce --worlds 2 --max-mib 4
    uv run python -m solutions.phase1_data_parallel.benchmarks.all_reduce \
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
from course.results import Table, write_results
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
MAX_WORLD = 16  # processes on one machine; more only measures the oversubscription


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


def ratio_to_torch(measurements: Sequence[Measurement]) -> dict[tuple[int, int, str], float]:
    """(world, bytes, strategy) -> median time / dist.all_reduce's median time at that cell."""
    reference = {
        (m.world_size, m.nbytes): m.median_seconds
        for m in measurements
        if m.strategy == "dist.all_reduce"
    }
    return {
        (m.world_size, m.nbytes, m.strategy): m.median_seconds / reference[(m.world_size, m.nbytes)]
        for m in measurements
        if (m.world_size, m.nbytes) in reference
    }


def results_table(measurements: Sequence[Measurement]) -> Table:
    """One row per (world, size, strategy); the ratio is time / dist.all_reduce's time."""
    ratios = ratio_to_torch(measurements)
    table = Table(
        [
            "world",
            "size",
            "strategy",
            "median ms",
            "algbw GB/s",
            "busbw GB/s",
            "time vs dist.all_reduce",
        ]
    )
    for m in measurements:
        ratio = ratios.get((m.world_size, m.nbytes, m.strategy))
        table.add(
            m.world_size,
            _human_bytes(m.nbytes),
            m.strategy,
            f"{1e3 * m.median_seconds:.3f}",
            f"{m.algbw / 1e9:.3f}",
            f"{m.busbw / 1e9:.3f}",
            f"{ratio:.2f}x" if ratio is not None else "-",
        )
    return table


def format_table(measurements: Sequence[Measurement]) -> str:
    """The table as markdown, as printed."""
    return results_table(measurements).to_markdown()


def _span(numbers: Sequence[float], unit: str = "x") -> str:
    if not numbers:
        return "none measured"
    low, high = min(numbers), max(numbers)
    return f"{low:.2f}{unit}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}{unit}"


SMALL, LARGE = 256 * KIB, 4 * 2**20  # latency-bound up to SMALL, bandwidth-bound from LARGE


def summary(measurements: Sequence[Measurement]) -> dict[str, str]:
    """What the guide says about the table, computed from it (so a re-run cannot contradict it):
    how often the hand-made strategies beat dist.all_reduce on small messages and lose on large
    ones, the ratios at the largest world, and dist.all_reduce's busbw on large messages."""
    ratios = ratio_to_torch(measurements)
    hand = [key for key in ratios if key[2] != "dist.all_reduce"]
    small = [key for key in hand if key[1] <= SMALL]
    large = [key for key in hand if key[1] >= LARGE]
    top = max((m.world_size for m in measurements), default=0)
    values = {
        "small_faster": f"{sum(ratios[k] < 1 for k in small)} of {len(small)}",
        "large_slower": f"{sum(ratios[k] > 1 for k in large)} of {len(large)}",
        "top_world": str(top),
        "small_top": _span([ratios[k] for k in small if k[0] == top]),
        "torch_busbw_large": _span(
            [
                m.busbw / 1e9
                for m in measurements
                if m.strategy == "dist.all_reduce" and m.nbytes >= LARGE
            ],
            " GB/s",
        ),
    }
    for name in ("reduce_broadcast", "direct_exchange"):
        values[f"large_top_{name}"] = _span(
            [ratios[k] for k in large if k[0] == top and k[2] == name]
        )
    return values


def run_benchmark(
    worlds: Sequence[int], sizes: Sequence[int], strategies: Sequence[str]
) -> list[Measurement]:
    unknown = [name for name in strategies if name not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}: choose from {', '.join(STRATEGIES)}")
    if not worlds or any(not 2 <= world <= MAX_WORLD for world in worlds):
        raise ValueError(
            f"--worlds {','.join(map(str, worlds))}: each world needs 2 to {MAX_WORLD} ranks "
            "(fix: e.g. --worlds 2,4)"
        )
    measurements: list[Measurement] = []
    for world in worlds:
        per_rank = run_world(measure_worker, world, (list(sizes), list(strategies)), timeout=900)
        measurements += per_rank[0]
    return measurements


@dataclass
class BenchmarkConfig:
    """The benchmark's flags (``--worlds``, ``--max-mib``, ``--strategies``)."""

    worlds: str = field(default="2,4", metadata={"help": "world sizes, comma-separated"})
    max_mib: float = field(
        default=64.0,
        metadata={
            "help": "largest message, MiB",
            "ge": 1 / 1024,
            "le": 1024,
            "fix": "a size from 1/1024 (1 KiB) to 1024 MiB, e.g. --max-mib 4",
        },
    )
    strategies: str = field(
        default=",".join(STRATEGIES),
        metadata={"help": f"comma-separated, from {', '.join(STRATEGIES)}"},
    )
    record: str = field(
        default="", metadata={"help": "also write the table to this results file (JSON)"}
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
    table = results_table(measurements)
    seconds = time.perf_counter() - started
    print(table.to_markdown())
    print(f"\n({seconds:.0f} s; torch {torch.__version__})")
    if config.record:
        values = summary(measurements) | {"seconds": f"{seconds:.0f} s"}
        path = write_results(config.record, tables={"all_reduce": table}, values=values)
        print(f"recorded {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
