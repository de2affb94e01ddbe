"""Benchmark of exercise 2.7: the work per rank with and without zig-zag, and when a pass hides.

Two measurements, each in worlds started here (``run_world``, gloo on CPU):

* **Balance** (causal attention, cp in ``--cps``): every rank runs ring attention forward and
  backward on its part of one sequence, in the contiguous and in the zig-zag layout. Per rank:
  the query-key pairs its blocks needed (counted, exact), the CPU seconds it spent inside the
  attention blocks (``record_block_work``: the rank's thread's CPU time, so ranks sharing a core
  do not inflate each other), and the step's wall time (the slowest rank's, median of
  ``--repeats``; with more ranks than cores the wall time measures the sharing, not the ring).
  "slowest / mean" is the imbalance: the ring moves at the pace of its slowest rank.
* **Compute against transfer** (cp = 2): for each local length L, the time of one full block of
  attention (L queries x L keys, forward) against the time of one ring pass of that block's K
  and V alone. A step hides its pass when the block takes at least as long as the pass: compute
  grows as L², the pass as L, so past some L every pass hides.

    uv run python -m solutions.phase2_advanced.benchmarks.context_parallel
    uv run python -m solutions.phase2_advanced.benchmarks.context_parallel --impl templates
    uv run python -m solutions.phase2_advanced.benchmarks.context_parallel \
        --record phase2_advanced/results/cp_balance.json
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from course.cli import benchmark_main, run_main
from course.impl import IMPLS, load_impl
from course.results import Table, write_results
from course.world import run_world
from phase2_advanced.ring_attention_blocks import (
    block_attention,
    record_block_work,
    start_ring_pass,
)

PHASE = "phase2_advanced"


@dataclass
class BenchmarkConfig:
    """What to measure; the defaults are what the guide's table records."""

    cps: str = field(default="2,4", metadata={"help": "context-parallel sizes, comma-separated"})
    seq_len: int = field(default=2048, metadata={"ge": 16, "help": "whole sequence (balance)"})
    heads: int = field(default=4, metadata={"ge": 1})
    head_dim: int = field(default=32, metadata={"ge": 1})
    repeats: int = field(default=3, metadata={"ge": 1, "le": 50})
    lengths: str = field(
        default="16,64,128,256,512,1024",
        metadata={"help": "local lengths L for compute vs transfer"},
    )
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "the reference or your phase2_advanced templates"},
    )
    record: str = field(default="", metadata={"help": "also write the tables to this JSON file"})


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give integers like 2,4") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r}: give positive integers like 2,4")
    return values


def validate(config: BenchmarkConfig) -> None:
    for cp in _ints(config.cps, "--cps"):
        if cp < 2 or cp > 8:
            raise ValueError(f"--cps {config.cps}: each size must be 2..8 (processes here)")
        if config.seq_len % (2 * cp):
            raise ValueError(
                f"--seq-len {config.seq_len} is not a multiple of 2·cp = {2 * cp}: the zig-zag "
                "layout needs equal chunks"
            )
    _ints(config.lengths, "--lengths")


# ---------------------------------------------------------------------------- balance


def _step(cp_module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, zigzag: bool) -> None:
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = cp_module.ring_attention(q, k, v, None, causal=True, zigzag=zigzag)
    out.backward(torch.ones_like(out))


def balance_worker(config: BenchmarkConfig) -> dict[str, Any]:
    """One rank: pairs, attention CPU seconds and step wall time (medians), per layout; and
    the CPU seconds of every repeat (``cpu_each``)."""
    layout = load_impl(PHASE, "context_parallel_layout", config.impl)
    cp_module = load_impl(PHASE, "context_parallel", config.impl)
    rank, cp = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    shape = (1, config.heads, config.seq_len, config.head_dim)
    whole = [torch.randn(shape, generator=generator) for _ in range(3)]
    found: dict[str, Any] = {}
    for name, zigzag in (("contiguous", False), ("zig-zag", True)):
        q, k, v = (layout.shard_sequence(t, rank, cp, zigzag=zigzag) for t in whole)
        _step(cp_module, q, k, v, zigzag)  # warm-up
        seconds, walls, pairs = [], [], 0
        for _ in range(config.repeats):
            dist.barrier()
            started = time.perf_counter()
            with record_block_work() as work:
                _step(cp_module, q, k, v, zigzag)
            wall = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            walls.append(float(wall))
            seconds.append(work.seconds())
            pairs = work.score_entries("forward")
        found[name] = {
            "pairs": pairs,
            "cpu": statistics.median(seconds),
            "wall": statistics.median(walls),
            "cpu_each": seconds,  # every repeat's, in order (tests.bench 2.7's verdict)
        }
    return found


# ---------------------------------------------------------------------------- overlap


def overlap_worker(config: BenchmarkConfig) -> list[dict[str, float]]:
    """cp = 2: one block's forward time against one ring pass of its K and V, per length."""
    rows = []
    repeats = max(3, config.repeats)
    for length in _ints(config.lengths, "--lengths"):
        shape = (1, config.heads, length, config.head_dim)
        q, k, v = (torch.randn(shape) for _ in range(3))
        block_attention(q, k, v)
        start_ring_pass([k, v]).wait()  # warm-up: the connection, the buffers
        computes, passes = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            block_attention(q, k, v)
            computes.append(time.perf_counter() - started)
            dist.barrier()
            started = time.perf_counter()
            start_ring_pass([k, v]).wait()
            passes.append(time.perf_counter() - started)
        rows.append(
            {
                "length": length,
                "bytes": 2 * k.numel() * k.element_size(),
                "compute": statistics.median(computes),
                "transfer": statistics.median(passes),
            }
        )
    return rows


@dataclass
class Results:
    balance: dict[int, list[dict[str, Any]]]
    overlap: list[dict[str, float]]


def measure(config: BenchmarkConfig) -> Results:
    balance = {
        cp: run_world(balance_worker, cp, (config,), timeout=600)
        for cp in _ints(config.cps, "--cps")
    }
    overlap = run_world(overlap_worker, 2, (config,), timeout=600)[0]
    return Results(balance, overlap)


def _ratio(values: Sequence[float]) -> float:
    return max(values) / statistics.mean(values)


def tables(results: Results) -> tuple[dict[str, Table], dict[str, str]]:
    balance = Table(
        [
            "cp",
            "layout",
            "query-key pairs per rank",
            "slowest / mean (pairs)",
            "attention CPU per rank (ms)",
            "slowest / mean (CPU)",
            "step, fwd+bwd (ms)",
        ]
    )
    values: dict[str, str] = {}
    lower = 0  # sizes where zig-zag's CPU imbalance is below contiguous's
    for cp, ranks in results.balance.items():
        ratios = {
            layout: _ratio([rank[layout]["cpu"] for rank in ranks])
            for layout in ("contiguous", "zig-zag")
        }
        lower += ratios["zig-zag"] < ratios["contiguous"]
        for layout in ("contiguous", "zig-zag"):
            pairs = [rank[layout]["pairs"] for rank in ranks]
            cpu = [rank[layout]["cpu"] for rank in ranks]
            wall = ranks[0][layout]["wall"]
            key = f"cp{cp}_{layout.replace('-', '')}"
            values[f"{key}_pairs"] = f"{_ratio(pairs):.2f}x"
            values[f"{key}_cpu"] = f"{_ratio(cpu):.2f}x"
            balance.add(
                cp,
                layout,
                f"{min(pairs)}-{max(pairs)}" if min(pairs) != max(pairs) else f"{pairs[0]}",
                f"{_ratio(pairs):.2f}x",
                f"{min(cpu) * 1e3:.0f}-{max(cpu) * 1e3:.0f}",
                f"{_ratio(cpu):.2f}x",
                f"{wall * 1e3:.0f}",
            )
    values["zigzag_cpu_lower"] = f"{lower} of {len(results.balance)}"
    overlap = Table(
        ["local length L", "K+V per pass", "one block (ms)", "one pass (ms)", "block / pass"]
    )
    hidden = []
    for row in results.overlap:
        ratio = row["compute"] / row["transfer"]
        if ratio >= 1:
            hidden.append(int(row["length"]))
        overlap.add(
            int(row["length"]),
            f"{row['bytes'] / 1024:.0f} KiB",
            f"{row['compute'] * 1e3:.2f}",
            f"{row['transfer'] * 1e3:.2f}",
            f"{ratio:.2f}",
        )
    lengths = [int(row["length"]) for row in results.overlap]
    if not hidden:
        values["hides_from"] = "at none of them"
    elif all(length in hidden for length in lengths if length >= min(hidden)):
        values["hides_from"] = f"from L = {min(hidden)} up"
    else:
        values["hides_from"] = "at L = " + ", ".join(map(str, hidden)) + " only"
    values["hides_count"] = f"{len(hidden)} of {len(lengths)}"
    return {"balance": balance, "overlap": overlap}, values


def report(results: Results, config: BenchmarkConfig) -> str:
    found, values = tables(results)
    text = (
        f"Causal ring attention, {config.heads} heads x head_dim {config.head_dim}, sequence "
        f"{config.seq_len}, float32, gloo on CPU ({config.impl}):\n\n"
        + found["balance"].to_markdown()
        + "\n\nOne block of attention against one ring pass of its K and V (cp = 2):\n\n"
        + found["overlap"].to_markdown()
        + f"\n\nthe block outlasts its pass (the pass hides) at {values['hides_count']} "
        f"measured lengths, {values['hides_from']}"
    )
    if config.record:
        path = write_results(config.record, tables=found, values=values)
        text += f"\nrecorded {path}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(
        BenchmarkConfig, argv, __doc__, validate=validate, measure=measure, report=report
    )


if __name__ == "__main__":
    run_main(main)
