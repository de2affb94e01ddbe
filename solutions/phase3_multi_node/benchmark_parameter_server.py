"""Sync, async and ssp on the parameter server, with and without stragglers: the table.

    uv run python -m solutions.phase3_multi_node.benchmark_parameter_server
    uv run python -m solutions.phase3_multi_node.benchmark_parameter_server --impl templates

Each run: S servers and W workers (processes, 127.0.0.1); each worker trains for the same wall
time (``--time-budget``) on its shard of the built-in dataset. ``--step-delay`` stands for the
compute time of a clock (the MLP itself takes about a millisecond, so without it the table would
measure Python and sockets only). Stragglers: none; worker 1 always 3x slower (a persistent
straggler); or on each clock a random 1/W of the workers 3x slower (transient stragglers, the
case SSP was designed for). Throughput is the samples of all workers over the wall time from the
first worker's start to the last one's end; accuracy is measured on the held-out split with the
servers' final parameters; medians over ``--repeats`` runs.

The claim to check (Ho et al. 2013): with stragglers, sync runs at the slowest worker's pace,
async never waits but computes on stale parameters, and ssp with a small staleness keeps most
of async's throughput with sync-like accuracy. The table reports what was measured, whichever
way it comes out.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from course.cli import parse_config, run_main
from course.impl import IMPLS
from phase3_multi_node.ps_launcher import PSConfig, run

STRAGGLERS = ("none", "worker 1", "random")


@dataclass
class BenchConfig:
    servers: int = 2
    workers: int = 3
    time_budget: float = field(default=3.0, metadata={"help": "seconds each worker trains"})
    staleness: int = 2
    step_delay: float = field(default=0.01, metadata={"help": "simulated compute s per clock"})
    slow_factor: float = 3.0
    repeats: int = 3
    lr: float = 0.05
    out: str = field(default="", metadata={"help": "also write the markdown table here"})
    impl: str = field(default="solutions", metadata={"choices": IMPLS})


@dataclass(frozen=True)
class Row:
    mode: str
    straggler: str
    throughput: float  # samples/s, median
    accuracy: float  # median
    clocks: tuple[int, int]  # fewest and most clocks a worker ran (of the median-throughput run)


def measure(config: BenchConfig, mode: str, straggler: str) -> Row:
    base = PSConfig(
        servers=config.servers,
        workers=config.workers,
        mode=mode,
        staleness=config.staleness,
        steps=1_000_000,
        time_budget=config.time_budget,
        lr=config.lr,
        step_delay=config.step_delay,
        slow_worker=1 if straggler == "worker 1" else -1,
        random_straggler=straggler == "random",
        slow_factor=config.slow_factor,
        impl=config.impl,
    )
    runs = []
    for _ in range(config.repeats):
        result, accuracy = run(replace(base), verbose=False)
        counts = [sum(len(r.clocks) for r in result.workers[w]) for w in sorted(result.workers)]
        runs.append((sum(counts) * base.batch_size / result.wall, accuracy, counts))
    runs.sort(key=lambda item: item[0])
    throughput, _, counts = runs[len(runs) // 2]
    accuracy = statistics.median(item[1] for item in runs)
    return Row(mode, straggler, throughput, accuracy, (min(counts), max(counts)))


def table(config: BenchConfig, rows: list[Row]) -> str:
    by = {(r.mode, r.straggler): r for r in rows}
    lines = [
        f"S={config.servers} servers, W={config.workers} workers, each trains for "
        f"{config.time_budget:g} s; batch 32 per worker; {config.step_delay * 1000:g} ms "
        f"simulated compute per clock; a slow clock takes {config.slow_factor:g}x as long; "
        f"ssp s={config.staleness}; median of {config.repeats} runs",
        "",
        "| straggler | mode | throughput (samples/s) | vs async, same straggler "
        "| clocks per worker (min-max) | test accuracy |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        mode = f"ssp (s={config.staleness})" if row.mode == "ssp" else row.mode
        who = {
            "none": "none",
            "worker 1": f"worker 1 always {config.slow_factor:g}x",
            "random": f"each clock 1/W of workers {config.slow_factor:g}x",
        }[row.straggler]
        ratio = row.throughput / by[("async", row.straggler)].throughput
        lines.append(
            f"| {who} | {mode} | {row.throughput:.0f} | {ratio:.2f} | "
            f"{row.clocks[0]}-{row.clocks[1]} | {row.accuracy:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(BenchConfig, argv, __doc__)
    if config.repeats < 1 or config.time_budget <= 0:
        print(f"error: --repeats {config.repeats} --time-budget {config.time_budget}: need > 0")
        return 2
    rows = []
    for straggler in STRAGGLERS:
        for mode in ("sync", "async", "ssp"):
            rows.append(measure(config, mode, straggler))
            print(f"measured {mode}, straggler: {straggler}", flush=True)
    text = table(config, rows)
    print(text)
    if config.out:
        with open(config.out, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
