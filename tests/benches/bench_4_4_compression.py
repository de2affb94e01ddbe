"""4.4's goal: each of your hooks sends exactly the bytes its method promises.

    uv run python -m tests.bench 4.4                    # your hooks (compression*.py templates)
    uv run python -m tests.bench 4.4 --impl solutions

Two ranks train the benchmark's MLP (256-256-256-10, 134,154 fp32 parameters) under torch's
``DistributedDataParallel`` for a few steps with each method, in one run: no compression (torch's
own all-reduce), torch's ``default_hooks.fp16_compress_hook``, and your fp16, bf16, top-k 1%,
PowerSGD r = 1 and r = 2 (compressed from step 2). On a compressed step, the bytes one rank hands
to collectives (an all-reduce's tensor, its own part of an all-gather) are compared with the
guide's formulas for the buckets DDP gave the hook: 2 bytes per element (fp16, bf16), k float32
values + k int64 indices with k = ceil(0.01 x the bucket's elements) (top-k), the factors
(n + m) x r of every matrix worth compressing plus every other element in fp32 (PowerSGD). The
goal is exact: no byte off. The table also shows how much smaller than no compression each is,
and how your fp16 compares with torch's. It needs only exercise 4.4.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from benches import verdict
from course.impl import unwritten_todo
from course.results import Table
from course.world import WorldError, run_world
from solutions.phase4_production.benchmarks import compression as bench

GOAL = "compression hooks: bytes per step per rank == the guide's formula (0 bytes off)"
MODULES = ("compression", "compression_topk", "compression_powersgd")


def table_of(rows: Sequence[dict[str, Any]]) -> tuple[Table, int]:
    """One row per method; and the largest difference from its formula."""
    table = Table(
        ["method", "buckets", "bytes/step/rank", "formula", "bytes off", "vs none",
         "vs torch fp16 hook"]
    )  # fmt: skip
    none = next(r["measured"] for r in rows if r["name"] == "none")
    torch_fp16 = next(r["measured"] for r in rows if r["name"] == "torch-fp16")
    worst = 0
    for r in rows:
        off = abs(r["measured"] - r["formula"])
        worst = max(worst, off)
        table.add(
            r["label"], r["buckets"], r["measured"], r["formula"], off,
            f"{none / r['measured']:.1f}x smaller", f"{r['measured'] / torch_fp16:.2f}x",
        )  # fmt: skip
    return table, worst


def main(argv: Sequence[str]) -> int:
    p = verdict.parser(__doc__.splitlines()[0])
    args = p.parse_args(list(argv))
    for module in MODULES:
        missing = unwritten_todo("phase4_production", module, args.impl)
        if missing:
            print(missing)
            return 2
    try:
        rows = run_world(bench.bytes_worker, 2, (args.impl,), {}, timeout=300)[0]
    except WorldError as err:
        print(f"the measurement could not run: {str(err).splitlines()[0]}")
        return 2
    table, worst = table_of(rows)
    print(f"4.4 compression hooks ({args.impl}): bytes one rank hands to collectives per step\n")
    print(table.to_markdown())
    goal = verdict.Goal(
        "largest difference between a method's bytes and its formula", 0, at_least=False,
        unit=" bytes",
    )  # fmt: skip
    print()
    print(goal.verdict(worst))
    return 0 if goal.met(worst) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
