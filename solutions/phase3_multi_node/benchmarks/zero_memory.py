"""Per-rank memory and communication of ZeRO stages 0-3, measured, beside the paper's formulas.

For each world size, an MLP in fp32 is trained a few steps with AdamW as:

* stage 0: plain data parallelism (every gradient all-reduced with ``dist.all_reduce``, averaged);
* stages 1, 2, 3: ``zero_wrap`` (exercise 3.5; ``--impl templates`` runs yours);
* ``ZeroRedundancyOptimizer`` over DDP, and FSDP2 ``fully_shard`` per layer (the library way).

Each row gives rank 0's measured bytes of parameters, gradients and optimizer state after a step
(distinct tensor storages; Adam's 0-dim ``step`` counters excluded), the paper's formula (Ψ padded
per layer to a multiple of N for stages 1-3), the bytes handed to collectives in one step counted
by their full buffers (all-gather output, reduce-scatter input, all-reduce twice: the paper's 2Ψ /
3Ψ accounting), and the median step time. DDP's all-reduce runs in C++ and is not visible to the
counter: its row shows what Python code handed over (the broadcasts of ZeroRedundancyOptimizer).
Timings on a shared 2-core machine are noisy; bytes are exact.

Then the FSDP-style ZeRO-3 of 3.5 (``zero_fsdp``, every Linear a unit, prefetch 1) beside
``fully_shard`` with the same ``MixedPrecisionPolicy`` (no mixed precision; bf16 compute with
fp32 or bf16 reduction; fp16): bytes per step per dtype against 2Ψ·b_param + Ψ·b_reduce, the
largest parameter difference after ``--steps`` steps, both step times measured in turn in the
same processes; the gathered bytes at the peak of one step for prefetch windows 0, 1, 2 and
every unit, against the window formula; and ZeRO stages 1-3 with the first Linear frozen against
the formulas with Φ frozen parameters whole on every rank.

    uv run python -m solutions.phase3_multi_node.benchmarks.zero_memory
    uv run python -m solutions.phase3_multi_node.benchmarks.zero_memory --worlds 2 --hidden 64
    uv run python -m solutions.phase3_multi_node.benchmarks.zero_memory --paper
    uv run python -m solutions.phase3_multi_node.benchmarks.zero_memory --paper \
        --record phase3_multi_node/results/zero_memory.json

``--record PATH`` writes the tables the guide quotes (course/results.py); ``uv run python -m
tests.bench 3.5`` checks every rank of your ZeRO against the formulas.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course.cli import parse_config, run_main
from course.comm_counter import CommCounter
from course.impl import IMPLS, load_impl, unwritten_todo
from course.models import MLP
from course.results import Table, write_results
from course.world import run_world
from solutions.phase3_multi_node.benchmarks import fsdp_measure as fsdp
from solutions.phase3_multi_node.library import zero as lib
from solutions.phase3_multi_node.references import zero_accounting as acc

ROWS = ("DP (stage 0)", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeroRedundancyOptimizer", "FSDP2")
IN_FEATURES = 256


@dataclass(frozen=True)
class Row:
    world: int
    name: str
    psi: int
    held: acc.ModelStateBytes
    formula: acc.ModelStateBytes | None
    volume: int
    formula_volume: int | None
    step_seconds: float


def _model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return MLP(IN_FEATURES, hidden=hidden, depth=3)


def _step_dp(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    world = dist.get_world_size()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    optimizer.step()


def measure_worker(hidden: int, steps: int, impl: str) -> list[Row]:
    """Every row on this world; rank 0's measurements (the others are equal or smaller)."""
    zero = load_impl("phase3_multi_node", "zero", impl)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16 * world, IN_FEATURES, generator=g), torch.randint(10, (16 * world,))
    xs, ys = x[rank * 16 : (rank + 1) * 16], y[rank * 16 : (rank + 1) * 16]
    rows = []
    for name in ROWS:
        model = _model(hidden)
        psi_plain = sum(p.numel() for p in model.parameters())
        stage = ROWS.index(name) if name.startswith(("DP", "ZeRO-")) else None
        if stage == 0:
            optimizer: Any = torch.optim.AdamW(model.parameters())
        elif stage is not None:
            model, optimizer = zero.zero_wrap(model, lambda ps: torch.optim.AdamW(ps), stage)
        elif name == "ZeroRedundancyOptimizer":
            model, optimizer = lib.zero_redundancy_adamw(model)
        else:
            model, optimizer = lib.fsdp2_adamw(model)
        times, volume = [], 0
        for step in range(steps):
            dist.barrier()
            start = time.perf_counter()
            with CommCounter() as comm:
                nn.functional.cross_entropy(model(xs), ys).backward()
                if stage == 0:
                    assert isinstance(optimizer, torch.optim.Optimizer)
                    _step_dp(model, optimizer)
                else:
                    optimizer.step()
            times.append(time.perf_counter() - start)
            if step == 0:
                volume = acc.collective_volume(comm.records, world) + sum(
                    r.nbytes for r in comm.records if r.op == "broadcast"
                )
                held = acc.held_bytes(model, optimizer)
            optimizer.zero_grad()
        psi = acc.padded_psi(model, world) if stage else psi_plain
        formula = acc.formula_bytes(stage, psi, world) if stage is not None else None
        formula_volume = acc.formula_volume(stage, psi) if stage is not None else None
        rows.append(
            Row(world, name, psi, held, formula, volume, formula_volume, statistics.median(times))
        )
    return rows


def world_worker(
    hidden: int, steps: int, impl: str, with_fsdp: bool
) -> tuple[list[Row], dict[str, Any]]:
    """Every measurement of one world size, in one world: the rows above, then the frozen-layer
    and FSDP-style rows (``benchmarks.fsdp_measure``)."""
    rows = measure_worker(hidden, steps, impl)
    return rows, fsdp.measure_worker(hidden, max(steps, 3), impl, with_fsdp)


def _kib(nbytes: float) -> str:
    return f"{nbytes / 1024:.1f}"


def memory_table(rows: Sequence[Row]) -> Table:
    """Measured vs formula bytes (KiB), communication, step time."""
    table = Table(
        ["N", "implementation", "Ψ", "params", "grads", "optimizer", "total", "formula total",
         "comm / step (formula)", "step ms"]
    )  # fmt: skip
    for row in rows:
        formula = "-" if row.formula is None else _kib(row.formula.total)
        if row.formula is not None and row.formula == row.held:
            formula += " (equal)"
        if row.name == "FSDP2":
            comm = "not visible (C++ collectives), 3Ψ by design"
        elif row.name == "ZeroRedundancyOptimizer":
            comm = f"{_kib(row.volume)} broadcast + DDP's all-reduce (C++, 2Ψ)"
        else:
            comm = f"{_kib(row.volume)} ({_kib(row.formula_volume or 0)})"
        table.add(
            row.world, row.name, row.psi, _kib(row.held.params), _kib(row.held.grads),
            _kib(row.held.optimizer), _kib(row.held.total), formula, comm,
            f"{row.step_seconds * 1e3:.1f}",
        )  # fmt: skip
    return table


def format_table(rows: Sequence[Row]) -> str:
    """A markdown table: measured vs formula bytes (KiB), communication, step time."""
    return memory_table(rows).to_markdown()


def summary_values(rows: Sequence[Row]) -> dict[str, str]:
    """How many ZeRO rows equal their formula, in bytes and in communication volume."""
    zero = [r for r in rows if r.formula is not None]
    bytes_equal = sum(r.formula == r.held for r in zero)
    volume_equal = sum(r.formula_volume == r.volume for r in zero)
    return {
        "bytes_equal": f"{bytes_equal} of {len(zero)}",
        "volume_equal": f"{volume_equal} of {len(zero)}",
    }


def per_rank_worker(hidden: int, impl: str) -> list[dict[str, Any]]:
    """ZeRO stages 1-3 on this world: this rank's bytes after one step beside the formula."""
    zero = load_impl("phase3_multi_node", "zero", impl)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16 * world, IN_FEATURES, generator=g), torch.randint(10, (16 * world,))
    xs, ys = x[rank * 16 : (rank + 1) * 16], y[rank * 16 : (rank + 1) * 16]
    out = []
    for stage in (1, 2, 3):
        model, optimizer = zero.zero_wrap(_model(hidden), lambda ps: torch.optim.AdamW(ps), stage)
        nn.functional.cross_entropy(model(xs), ys).backward()
        optimizer.step()
        psi = acc.padded_psi(model, world)
        out.append(
            {
                "world": world, "rank": rank, "stage": stage, "psi": psi,
                "held": acc.held_bytes(model, optimizer),
                "formula": acc.formula_bytes(stage, psi, world),
            }
        )  # fmt: skip
        optimizer.zero_grad()
    return out


def paper_rows(psi: float = 7.5e9, world: int = 64) -> Table:
    """The paper's Figure 1 example (7.5B parameters, N = 64): GB per rank, fp32 and mixed
    precision (K = 12)."""
    table = Table(["stage", "fp32 Adam (4+4+8)Ψ", "mixed precision (2+2+12)Ψ"])
    n = int(psi) - int(psi) % world
    for stage in range(4):
        fp32 = acc.formula_bytes(stage, n, world).total / 1e9
        mixed = acc.formula_bytes(stage, n, world, p=2, g=2, k=12).total / 1e9
        table.add(stage, f"{fp32:.1f}", f"{mixed:.1f}")
    return table


def paper_table(psi: float = 7.5e9, world: int = 64) -> str:
    """The paper's Figure 1 example as printed text."""
    head = f"Ψ = {psi:.2g} parameters, N = {world} ranks, GB per rank:"
    return head + "\n\n" + paper_rows(psi, world).to_markdown()


MAX_WORLD = 16


@dataclass
class BenchConfig:
    worlds: str = field(
        default="2,4", metadata={"help": f"comma-separated world sizes, 1 to {MAX_WORLD}"}
    )
    hidden: int = field(
        default=256,
        metadata={
            "help": "MLP width (3 hidden layers)",
            "ge": 1,
            "le": 8192,
            "fix": "a width from 1 to 8192, e.g. 256",
        },
    )
    steps: int = field(
        default=5,
        metadata={"help": "steps per row", "ge": 1, "le": 1000, "fix": "1 to 1000 steps, e.g. 5"},
    )
    impl: str = field(default="solutions", metadata={"choices": IMPLS})
    paper: bool = field(default=False, metadata={"help": "print the paper's 7.5B example too"})
    record: str = field(
        default="", metadata={"help": "write the tables to this results file (course/results.py)"}
    )


def parse_worlds(text: str) -> list[int]:
    """``"2,4"`` -> ``[2, 4]``, or a ValueError naming the flag, the value and the fix."""
    try:
        worlds = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"--worlds {text!r}: give world sizes like 2,4") from None
    if not worlds or not all(1 <= w <= MAX_WORLD for w in worlds):
        raise ValueError(f"--worlds {text}: each world size must be 1 to {MAX_WORLD}, e.g. 2,4")
    return worlds


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(BenchConfig, argv, __doc__)
    try:
        worlds = parse_worlds(config.worlds)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows: list[Row] = []
    policies: list[dict[str, Any]] = []
    windows: list[dict[str, Any]] = []
    frozen: list[dict[str, Any]] = []
    with_fsdp = not any(  # the FSDP-style part needs its own TODOs of 3.5
        unwritten_todo("phase3_multi_node", module, config.impl)
        for module in ("zero_fsdp_units", "zero_fsdp")
    )
    for world in worlds:
        mine, extra = run_world(
            world_worker, world, (config.hidden, config.steps, config.impl, with_fsdp), {},
            timeout=300,
        )[0]  # fmt: skip
        rows += mine
        frozen += extra["frozen"]
        policies += extra["policies"]
        windows += extra["windows"]
    print(format_table(rows))
    print("\nZeRO with the first Linear frozen (Φ parameters whole on every rank):\n")
    print(fsdp.frozen_table(frozen).to_markdown())
    if policies:
        print("\nFSDP-style ZeRO-3 (prefetch 1) beside fully_shard, same policy:\n")
        print(fsdp.policy_table(policies).to_markdown())
        print("\nGathered parameters at the peak of one step (bf16 compute), by window:\n")
        print(fsdp.window_table(windows).to_markdown())
    else:
        print("\n(FSDP-style part skipped: its TODOs of 3.5 are not written yet)")
    if config.paper:
        print()
        print(paper_table())
    if config.record:
        tables = {"memory": memory_table(rows), "frozen": fsdp.frozen_table(frozen)}
        values = summary_values(rows)
        if policies:
            tables |= {"fsdp": fsdp.policy_table(policies),
                       "fsdp_windows": fsdp.window_table(windows)}  # fmt: skip
            values |= fsdp.summary(policies, windows, frozen)
        if config.paper:
            tables["paper"] = paper_rows()
        path = write_results(config.record, tables=tables, values=values)
        print(f"\nrecorded: {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
