"""3.1's speed goal: your ring's busbw against ``dist.all_reduce``'s at 16 and 64 MiB.

    uv run python -m tests.bench 3.1                 # world 2 (the guide's goal), your ring
    uv run python -m tests.bench 3.1 --world 4       # another world (4 ranks on 2 cores: noisy)
    uv run python -m tests.bench 3.1 --impl solutions --quick

Both all-reduces run in the same processes, iterations interleaved (iteration i of each before
iteration i+1 of either), each timed as the slowest rank's; busbw follows nccl-tests
(algbw·2(n-1)/n). Each iteration pair gives one ratio; the verdict reads their median and middle
half against the goal, and the machine's load (tests/benches/verdict.py): ``goal met``, ``goal
not met``, or ``inconclusive`` (a busy machine, or a spread across the goal: re-run).
``--repeats N``: N iteration pairs at 64 MiB (a narrower spread). It needs only exercise 3.1:
halving-doubling, the hierarchical all-reduce and the alpha-beta fit (3.2, 3.3) are not run. The ring's result is checked against
the sum before it is timed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from benches import verdict
from course.world import WorldError
from solutions.phase3_multi_node.benchmarks import collectives as bench

GOAL = "3.1: ring busbw >= 0.95x dist.all_reduce's at 16 and 64 MiB (world 2)"
SIZES = bench.GOAL_SIZES
REPEATS = bench.iterations_for(max(SIZES), 2)  # at 64 MiB, world 2; 16 MiB gets a few more


def main(argv: Sequence[str]) -> int:
    p = verdict.parser(__doc__.splitlines()[0], repeats=REPEATS)
    p.add_argument("--world", type=int, default=2, help="ranks (default 2, the guide's goal)")
    args = p.parse_args(list(argv))
    if not 2 <= args.world <= 8:
        print(f"--world {args.world}: give 2 to 8 ranks (the goal is stated for 2)")
        return 2
    if args.repeats is not None and not 2 <= args.repeats <= 1000:
        print(f"--repeats {args.repeats}: give 2 to 1000 iteration pairs per cell")
        return 2
    missing = bench.missing_for("ring", args.impl)
    if missing:
        print(missing)
        return 2
    # --repeats N: N pairs at 64 MiB (the cell with the fewest); --quick: 0.4x the default
    scale = args.repeats / REPEATS if args.repeats else 0.4 if args.quick else 1.0
    meter = verdict.LoadMeter()
    try:
        rows = bench.run_benchmark(
            [args.world], list(SIZES), ["ring", "dist.all_reduce"], impl=args.impl,
            nodes=1, scale=scale, timeout=600, meter=meter,
        )  # fmt: skip
    except WorldError as err:
        print(f"the measurement could not run: {str(err).splitlines()[0]}")
        return 2
    load = meter.read()
    table = bench.goal_table(rows, load)
    pairs = min(row.iterations for row in rows)
    print(
        f"3.1 ring ({args.impl}) against dist.all_reduce, world {args.world}, gloo; iterations "
        f"interleaved (ring, dist.all_reduce, ring, ...), {pairs}+ pairs per size, each timed "
        "as the slowest rank's; ratio: the median of the pairs' busbw ratios, middle half: "
        "their interquartile range\n"
    )
    print(table.to_markdown())
    print(f"\n{table.note}\n")
    cells = {
        f"world {world}, {bench.human(nbytes)}": ratios
        for (world, nbytes), (_, _, ratios) in bench.goal_pairs(rows).items()
    }
    goal = verdict.Goal("ring busbw / dist.all_reduce busbw", bench.GOAL_RATIO)
    overall, _ = goal.judge_cells(cells, load, more=verdict.more_repeats(pairs))
    return verdict.finish(overall)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
