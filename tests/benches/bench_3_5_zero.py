"""3.5's goal: the bytes every rank holds under your ZeRO equal the paper's formulas, exactly.

    uv run python -m tests.bench 3.5                    # your ZeRO, worlds 2 and 4
    uv run python -m tests.bench 3.5 --impl solutions --quick   # world 2 only

An fp32 MLP (256 wide, 3 hidden layers: Ψ = 199,946) takes one AdamW step under your
``zero_wrap`` for stages 1, 2 and 3, on every rank of each world. The bytes each rank holds then
(distinct tensor storages: parameters, gradients, optimizer state, as the 3.5 grader counts
them) are compared with the ZeRO paper's formulas (Rajbhandari et al., SC 2020, section 5) with
p = g = 4 bytes, K = 8 (Adam's two moments) and Ψ padded per layer to a multiple of N:
stage 1 2pΨ + KΨ/N, stage 2 pΨ + (g+K)Ψ/N, stage 3 (p+g+K)Ψ/N. The goal is exact: no byte off.

When the FSDP-style part of 3.5 is written (``template_zero_fsdp_units.py``,
``template_zero_fsdp.py``), the same MLP also runs under your ``fsdp_wrap`` with each mixed
precision policy (none; bf16 compute with fp32 or bf16 reduction; fp16), beside ``fully_shard``
with the same policy in the same processes: the bytes one step hands to collectives, per dtype,
must equal 2Ψ·b_param (all-gathers) + Ψ·b_reduce (reduce-scatters), exactly too. It needs only
exercise 3.5.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from benches import verdict
from course.impl import unwritten_todo
from course.results import Table
from course.world import WorldError, run_world
from solutions.phase3_multi_node.benchmarks import fsdp_measure as fsdp
from solutions.phase3_multi_node.benchmarks import zero_memory as bench

GOAL = "3.5: ZeRO stages 1-3: bytes held by every rank == the paper's formulas (0 bytes off)"
MODULES = ("zero_partition", "zero_units", "zero")


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.1f}"


def table_of(results: Sequence[dict[str, Any]]) -> tuple[Table, int]:
    """One row per (world, stage, rank): measured against formula; and the largest gap."""
    table = Table(["N", "stage", "rank", "Ψ (padded)", "params KiB", "grads KiB",
                   "optimizer KiB", "formula KiB (p/g/opt)", "bytes off"])  # fmt: skip
    worst = 0
    for r in results:
        held, want = r["held"], r["formula"]
        off = sum(
            abs(getattr(held, part) - getattr(want, part))
            for part in ("params", "grads", "optimizer")
        )
        worst = max(worst, off)
        formula = f"{_kib(want.params)}/{_kib(want.grads)}/{_kib(want.optimizer)}"
        table.add(r["world"], r["stage"], r["rank"], r["psi"], _kib(held.params),
                  _kib(held.grads), _kib(held.optimizer), formula, off)  # fmt: skip
    return table, worst


FSDP = ("zero_fsdp_units", "zero_fsdp")


def fsdp_bytes_table(rows: Sequence[dict[str, Any]]) -> tuple[Table, int]:
    """One row per (world, policy): bytes per dtype against the formula; the largest gap."""
    table = Table(["N", "policy", "all-gathers (bytes)", "reduce-scatters (bytes)",
                   "formula", "fully_shard's step ms", "yours ms", "bytes off"])  # fmt: skip
    worst = 0
    for r in rows:
        off = 0
        for op in ("all_gather", "reduce_scatter"):
            got, want = r["comm"].get(op, {}), r["formula"][op]
            off += sum(abs(got.get(k, 0) - want.get(k, 0)) for k in {*got, *want})
        worst = max(worst, off)
        formula = ", ".join(f"{k} {n}" for op in ("all_gather", "reduce_scatter")
                            for k, n in r["formula"][op].items())  # fmt: skip
        table.add(r["world"], r["policy"], _dtypes(r["comm"].get("all_gather", {})),
                  _dtypes(r["comm"].get("reduce_scatter", {})), formula,
                  f"{r['torch_ms']:.1f}", f"{r['ours_ms']:.1f}", off)  # fmt: skip
    return table, worst


def _dtypes(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "none"


def main(argv: Sequence[str]) -> int:
    p = verdict.parser(__doc__.splitlines()[0])
    args = p.parse_args(list(argv))
    for module in MODULES:
        missing = unwritten_todo("phase3_multi_node", module, args.impl)
        if missing:
            print(missing)
            return 2
    worlds = [2] if args.quick else [2, 4]
    results: list[dict[str, Any]] = []
    try:
        for world in worlds:
            for per_rank in run_world(
                bench.per_rank_worker, world, (256, args.impl), {}, timeout=300
            ):
                results += per_rank
    except WorldError as err:
        print(f"the measurement could not run: {str(err).splitlines()[0]}")
        return 2
    results.sort(key=lambda r: (r["world"], r["stage"], r["rank"]))
    table, worst = table_of(results)
    print(f"3.5 ZeRO ({args.impl}): bytes after one AdamW step, every rank, fp32 MLP\n")
    print(table.to_markdown())
    skipped = next(
        (m for m in (unwritten_todo("phase3_multi_node", mod, args.impl) for mod in FSDP) if m),
        None,
    )
    if skipped:
        print(f"\nFSDP-style part skipped: {skipped}")
    else:
        policies: list[dict[str, Any]] = []
        try:
            for world in worlds:
                policies += run_world(fsdp.policy_worker, world, (256, 3, args.impl), {},
                                      timeout=300)[0]  # fmt: skip
        except WorldError as err:
            print(f"the FSDP-style measurement could not run: {str(err).splitlines()[0]}")
            return 2
        fsdp_table, fsdp_worst = fsdp_bytes_table(policies)
        print(f"\n3.5 FSDP-style ZeRO-3 ({args.impl}): bytes of one step per dtype, rank 0\n")
        print(fsdp_table.to_markdown())
        worst = max(worst, fsdp_worst)
    goal = verdict.Goal(
        "largest difference between a rank's bytes and the formula", 0, at_least=False,
        unit=" bytes",
    )  # fmt: skip
    print()
    print(goal.verdict(worst))
    return 0 if goal.met(worst) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
