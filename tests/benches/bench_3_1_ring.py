"""3.1's speed goal: your ring's busbw against ``dist.all_reduce``'s at 16 and 64 MiB.

    uv run python -m tests.bench 3.1                 # world 2 (the guide's goal), your ring
    uv run python -m tests.bench 3.1 --world 4       # another world (4 ranks on 2 cores: noisy)
    uv run python -m tests.bench 3.1 --impl solutions --quick

Both all-reduces run in the same processes, iterations interleaved (iteration i of each before
iteration i+1 of either), each timed as the slowest rank's, medians compared; busbw follows
nccl-tests (algbw·2(n-1)/n). It needs only exercise 3.1: halving-doubling, the hierarchical
all-reduce and the alpha-beta fit (3.2, 3.3) are not run. The ring's result is checked against
the sum before it is timed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from benches import verdict
from course.world import WorldError
from solutions.phase3_multi_node import benchmark_collectives as bench

GOAL = "3.1: ring busbw >= 0.95x dist.all_reduce's at 16 and 64 MiB (world 2)"
SIZES = bench.GOAL_SIZES


def main(argv: Sequence[str]) -> int:
    p = verdict.parser(__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="ranks (default 2, the guide's goal)")
    args = p.parse_args(list(argv))
    if not 2 <= args.world <= 8:
        print(f"--world {args.world}: give 2 to 8 ranks (the goal is stated for 2)")
        return 2
    missing = bench.missing_for("ring", args.impl)
    if missing:
        print(missing)
        return 2
    scale = 0.4 if args.quick else 1.0
    try:
        rows = bench.run_benchmark(
            [args.world], list(SIZES), ["ring", "dist.all_reduce"], impl=args.impl,
            nodes=1, scale=scale, timeout=600,
        )  # fmt: skip
    except WorldError as err:
        print(f"the measurement could not run: {str(err).splitlines()[0]}")
        return 2
    table = bench.goal_table(rows)
    print(
        f"3.1 ring ({args.impl}) against dist.all_reduce, world {args.world}, gloo; medians of "
        f"{rows[0].iterations}+ iterations, slowest rank\n"
    )
    print(table.to_markdown())
    worst = min(float(row[4].rstrip("x")) for row in table.rows)
    print()
    goal = verdict.Goal(
        f"ring busbw / dist.all_reduce busbw, worst of {len(table.rows)} cells",
        bench.GOAL_RATIO,
    )
    print(goal.verdict(worst))
    return 0 if goal.met(worst) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
