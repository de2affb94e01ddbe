"""3.4's goal: a training step with your DDP takes at most 1.05x the time of torch's DDP.

    uv run python -m tests.bench 3.4                    # your DDP, torch's default buckets
    uv run python -m tests.bench 3.4 --impl solutions --quick

One world of 2 ranks trains the same MLP (4 x Linear(2048, 2048), 64 MiB of fp32 gradients;
``--quick``: 1024 wide, fewer repeats) with your ``DistributedDataParallel`` and with torch's,
in the same processes, steps alternating so that load on the machine hits both alike; each
step is timed as the slowest rank's (zero_grad, forward, backward with the averaging inside it,
SGD step). Each pair of steps (yours i, torch's i) gives one ratio; the verdict reads their
median and middle half against the goal, and the machine's load (tests/benches/verdict.py):
``goal met``, ``goal not met``, or ``inconclusive`` (a busy machine, or a spread across the
goal: re-run, ``--repeats N`` for more pairs). It needs only exercise 3.4 (``ddp_buckets`` and
``ddp``). The detailed table (overlap, communication alone, other bucket caps) is
``solutions.phase3_multi_node.benchmarks.ddp``'s.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from benches import verdict
from course.impl import unwritten_todo
from course.world import WorldError
from solutions.phase3_multi_node.benchmarks import ddp as bench

GOAL = "3.4: step time with your DDP <= 1.05x torch DDP's (2 ranks, 64 MiB of gradients)"
REPEATS = 20


def main(argv: Sequence[str]) -> int:
    p = verdict.parser(__doc__.splitlines()[0], repeats=REPEATS)
    args = p.parse_args(list(argv))
    if args.repeats is not None and not 2 <= args.repeats <= 1000:
        print(f"--repeats {args.repeats}: give 2 to 1000 step pairs")
        return 2
    for module in ("ddp_buckets", "ddp"):
        missing = unwritten_todo("phase3_multi_node", module, args.impl)
        if missing:
            print(missing)
            return 2
    steps = args.repeats or (6 if args.quick else REPEATS)
    config = bench.BenchmarkConfig(width=1024 if args.quick else 2048, steps=steps, impl=args.impl)
    try:
        results = bench.measure(config)
    except WorldError as err:
        print(f"the measurement could not run: {str(err).splitlines()[0]}")
        return 2
    print(bench.header(results, config) + "\n")
    table = bench.ddp_table(results, config.impl)
    print(table.to_markdown())
    print(f"\n{table.note}\n")
    load = bench.run_load(results) or verdict.Load.quiet()
    goal = verdict.Goal("step time, your DDP / torch DDP", bench.GOAL_RATIO, at_least=False)
    result = goal.judge(
        bench.step_pair_ratios(results[0]), load, per="step pair", more=verdict.more_repeats(steps)
    )
    return verdict.finish(result)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
