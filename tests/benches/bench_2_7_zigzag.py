"""Exercise 2.7's goal: with the zig-zag layout, every rank of the ring does the same causal work.

Your ring attention (``template_context_parallel.py`` on ``template_context_parallel_layout.py``)
runs causal attention forward and backward on one sequence in worlds of cp = 2 and 4 processes,
in the contiguous layout and in the zig-zag one. Per rank it counts the query-key pairs its
blocks needed and measures the CPU time its thread spent inside them (``record_block_work``:
thread time, so ranks sharing a core do not count each other's work). The ring moves at the pace
of its slowest rank, so the goal is about the slowest rank over the mean, in the zig-zag layout;
the contiguous layout runs beside it, in the same run, to show what zig-zag removes.

Each repeat gives one ratio (its slowest rank's CPU time over the mean); the verdict reads their
median and middle half against the goal, and the machine's load (tests/benches/verdict.py):
``goal met``, ``goal not met``, or ``inconclusive`` (a busy machine, or a spread across the goal:
re-run, ``--repeats N`` for more).

    uv run python -m tests.bench 2.7                    # your code (the templates)
    uv run python -m tests.bench 2.7 --impl solutions   # the reference
    uv run python -m tests.bench 2.7 --quick            # a shorter sequence, one repeat
    uv run python -m tests.bench 2.7 --repeats 7        # more repeats: a narrower spread

Only the TODOs of 2.7 are needed.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence

from benches import verdict
from course.cli import todo_line
from course.impl import load_impl
from course.world import RankFailed, WorldError, run_world
from phase2_advanced.ring_attention_blocks import block_attention
from solutions.phase2_advanced.benchmarks.context_parallel import BenchmarkConfig, balance_worker

PHASE = "phase2_advanced"
TARGET = 1.15
CPS = (2, 4)
GOAL = (
    f"2.7: zig-zag layout, slowest rank's attention CPU time / mean <= {TARGET}x at cp = 2 and 4 "
    "(causal ring attention, forward and backward)"
)


def check_todos(impl: str) -> None:
    """Call the pure TODOs here first: an unwritten one is one line, not one per rank."""
    import torch

    layout = load_impl(PHASE, "context_parallel_layout", impl)
    cp_module = load_impl(PHASE, "context_parallel", impl)
    layout.zigzag_chunk_ids(0, 2)
    layout.block_kind(1, 0, causal=True)
    q = torch.zeros(1, 1, 2, 2)
    out, lse = block_attention(q, q, q)
    cp_module.merge_partials(out, lse, out, lse)


def balance_ratios(ranks: Sequence[dict], layout: str) -> list[float]:
    """Per repeat: the slowest rank's attention CPU time over the ranks' mean."""
    each = [rank[layout]["cpu_each"] for rank in ranks]
    return [max(cpu) / statistics.mean(cpu) for cpu in zip(*each, strict=True)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = verdict.parser(__doc__.split("\n\n")[0], repeats=3)
    args = parser.parse_args(argv)
    if args.repeats is not None and not 1 <= args.repeats <= 50:
        print(f"error: --repeats {args.repeats}: use 1 to 50", file=sys.stderr)
        return 2
    try:
        check_todos(args.impl)
    except NotImplementedError as exc:
        print(todo_line(exc), file=sys.stderr)
        return 2
    repeats = args.repeats or (1 if args.quick else 3)
    config = BenchmarkConfig(seq_len=1024 if args.quick else 2048, repeats=repeats, impl=args.impl)
    print(
        f"2.7 balance ({args.impl}): causal ring attention, sequence {config.seq_len}, "
        f"{config.heads} heads x {config.head_dim}, float32, forward + backward"
    )
    print(f"{'cp':>3}  {'layout':<11}{'pairs: slowest/mean':>21}{'CPU: slowest/mean':>19}")
    cells: dict[str, list[float]] = {}
    meter = verdict.LoadMeter()
    for cp in CPS:
        try:
            with meter.running(processes=cp):
                ranks = run_world(balance_worker, cp, (config,), timeout=600.0)
        except RankFailed as err:
            if err.exc_type == "NotImplementedError":
                print(
                    f"{err.message.replace(':', ' not written:', 1)} (rank {err.rank})",
                    file=sys.stderr,
                )
                return 2
            print(f"error: cp={cp}: {str(err).splitlines()[0]}", file=sys.stderr)
            return 2
        except WorldError as err:
            print(f"error: cp={cp}: {str(err).splitlines()[0]}", file=sys.stderr)
            return 2
        for layout in ("contiguous", "zig-zag"):
            pairs = [rank[layout]["pairs"] for rank in ranks]
            cpu = [rank[layout]["cpu"] for rank in ranks]
            pair_ratio = max(pairs) / statistics.mean(pairs)
            cpu_ratio = max(cpu) / statistics.mean(cpu)
            if layout == "zig-zag":
                cells[f"cp={cp}"] = balance_ratios(ranks, layout)
            print(f"{cp:>3}  {layout:<11}{pair_ratio:>20.2f}x{cpu_ratio:>18.2f}x", flush=True)
    load = meter.read()
    goal = verdict.Goal("zig-zag slowest rank's attention CPU / mean", TARGET, False)
    judged, _ = goal.judge_cells(cells, load, per="repeat", more=verdict.more_repeats(repeats))
    return verdict.finish(judged)


if __name__ == "__main__":
    sys.exit(main())
