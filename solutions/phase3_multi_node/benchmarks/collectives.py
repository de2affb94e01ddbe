"""Benchmark the ring, halving-doubling and hierarchical all-reduces beside ``dist.all_reduce``.

For each world size and each message size (1 KiB to 64 MiB by powers of four), every algorithm
runs a few timed iterations, **interleaved**: iteration i of every algorithm runs before
iteration i+1 of any, so a burst of load on a shared machine hits them all alike. An iteration
starts after a barrier and counts the slowest rank's time; the table shows the median. Bandwidths
follow nccl-tests (doc/PERFORMANCE.md): algbw = S / t, busbw = algbw · 2(n-1)/n. The hierarchical
all-reduce runs on ``--nodes`` simulated nodes (run_world lays the ranks out as torchrun would).

The ring's speed goal (busbw >= 0.95x ``dist.all_reduce``'s at 16 and 64 MiB) is judged per cell
from the ratio of each iteration pair (ring i against ``dist.all_reduce`` i), by
``course/verdicts.py``'s rule: met when the middle half of those ratios reaches 0.95x, not met
when it stays below on a machine that is not busy, inconclusive otherwise (a busy machine, or a
spread that straddles the goal); the 1-minute load around the run is read and recorded with it.

Then, per algorithm and world, alpha and beta are fitted to the medians with the algorithm's own
counts (solutions/phase3_multi_node/alpha_beta.py, ``--impl`` chooses whose), and the predicted
crossover sizes are printed: below them the algorithm with fewer messages wins, above them the
one with the faster per-byte term.

    uv run python -m solutions.phase3_multi_node.benchmarks.collectives --world 2 --world 4
    uv run python -m solutions.phase3_multi_node.benchmarks.collectives --world 2 --max-mib 4 \
        --algorithms ring,dist.all_reduce --json rows.json --plot busbw.png
    uv run python -m solutions.phase3_multi_node.benchmarks.collectives --impl templates
    uv run python -m solutions.phase3_multi_node.benchmarks.collectives --world 2 --world 4 \
        --record phase3_multi_node/results/collectives.json

With ``--impl templates`` an algorithm whose exercise is not written yet is skipped with one line
(halving-doubling needs 3.2, hierarchical 3.3 and 3.1), and so is the fit (3.2's
``alpha_beta``): the other rows are measured and printed all the same. Before timing, each
algorithm's result is checked against the sum; a wrong one stops the run naming it.
``--record PATH`` writes the tables and the figures the guide quotes (course/results.py).

The harness's point-to-point ledger (a hang diagnostic of run_world) is switched off here
(``DTFS_P2P_LEDGER=0``): it adds about 10 us to every isend/irecv, which ``dist.all_reduce``
never pays.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course.cli import parse_config, run_main
from course.impl import IMPLS, load_impl, unwritten_todo
from course.results import Table, write_results
from course.topology import Topology
from course.verdicts import Goal, Load, LoadMeter, Verdict, interleave, pair_ratios, tally
from course.world import WorldError, run_world

PHASE = "phase3_multi_node"
KIB, MIB = 1024, 2**20
MAX_WORLD = 32
ALGORITHMS = ("ring", "halving_doubling", "hierarchical", "dist.all_reduce")
# --algorithms may also name these, for the ablation of the ring's speed (ring_study/variants.py)
EXTRA_ALGORITHMS = (
    "ring_simple",
    "ring_plain",
    "ring_unpipelined",
    "ring_unfused",
    "ring_one_connection",
)
# the exercise modules each algorithm runs (under --impl); the ablation's variants are the
# reference's own (ring_study/variants.py) apart from ring_unpipelined, which is the --impl ring
NEEDS: dict[str, tuple[str, ...]] = {
    "ring": ("ring_allreduce",),
    "ring_unpipelined": ("ring_allreduce",),
    "halving_doubling": ("tree_allreduce",),
    "hierarchical": ("hierarchical_allreduce", "ring_allreduce"),
}
FIT_NEEDS = ("alpha_beta",)
GOAL_SIZES = (16 * 2**20, 64 * 2**20)  # the ring's speed goal: busbw >= 0.95x at these sizes
GOAL_RATIO = 0.95


def missing_for(algorithm: str, impl: str) -> str | None:
    """Why ``algorithm`` cannot run under ``impl`` (an unwritten TODO), or None."""
    for module in NEEDS.get(algorithm, ()):
        reason = unwritten_todo(PHASE, module, impl)
        if reason:
            return reason
    return None


@dataclass(frozen=True)
class Row:
    """One (world, size, algorithm) median, with nccl-tests' bandwidths; ``times`` are the
    iterations' seconds in order (iteration i of every algorithm ran before i+1 of any)."""

    world: int
    nbytes: int
    algorithm: str
    median_s: float
    iterations: int
    times: tuple[float, ...] = ()
    cpu_s: float = 0.0  # median CPU seconds of one call, all ranks' processes (user + system)

    @property
    def algbw(self) -> float:
        return self.nbytes / self.median_s

    @property
    def busbw(self) -> float:
        return self.algbw * 2 * (self.world - 1) / self.world

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "algbw_Bps": self.algbw, "busbw_Bps": self.busbw}


def default_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """``min_bytes``, x4, x4, ... up to ``max_bytes``."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def iterations_for(nbytes: int, world: int, scale: float = 1.0) -> int:
    """More repeats for small messages (noisy), fewer for large ones (slow)."""
    traffic = nbytes * world
    base = 15 if traffic >= 64 * MIB else 21 if traffic >= 4 * MIB else 31
    return max(3, round(base * scale))


def _functions(impl: str, topology: Topology, segment_bytes: int) -> dict[str, Callable[..., Any]]:
    ring = load_impl(PHASE, "ring_allreduce", impl)
    tree = load_impl(PHASE, "tree_allreduce", impl)
    hierarchical = load_impl(PHASE, "hierarchical_allreduce", impl)
    from solutions.phase3_multi_node.ring_study.variants import (
        one_connection_ring_all_reduce,
        plain_ring_all_reduce,
        simple_ring_all_reduce,
        unfused_ring_all_reduce,
    )

    return {
        "ring": lambda t: ring.ring_all_reduce(t, segment_bytes=segment_bytes),
        "ring_simple": simple_ring_all_reduce,
        "ring_plain": plain_ring_all_reduce,
        "ring_unpipelined": lambda t: ring.ring_all_reduce(t, segment_bytes=2**62),
        "ring_unfused": lambda t: unfused_ring_all_reduce(t, segment_bytes=segment_bytes),
        "ring_one_connection": lambda t: one_connection_ring_all_reduce(
            t, segment_bytes=segment_bytes
        ),
        "halving_doubling": tree.halving_doubling_all_reduce,
        "hierarchical": lambda t: hierarchical.hierarchical_all_reduce(t, topology),
        "dist.all_reduce": dist.all_reduce,
    }


def measure_worker(
    sizes: Sequence[int], algorithms: Sequence[str], impl: str, segment_bytes: int, scale: float
) -> list[Row]:
    """Runs on every rank of a world; rank 0 returns the rows."""
    topology = Topology.build()
    functions = _functions(impl, topology, segment_bytes)
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for nbytes in sizes:
        tensor = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        for name in algorithms:  # warm-up: connections, pooled buffers, first-touch pages
            tensor.fill_(1.0)
            functions[name](tensor)
            if not bool((tensor == world).all()):  # the sum of ones over the world
                wrong = int((tensor != world).sum())
                raise ValueError(
                    f"{name} on {world} ranks, {nbytes} bytes: {wrong} of {tensor.numel()} "
                    f"elements differ from the sum ({world}) on rank {rank}; timing a wrong "
                    "all-reduce means nothing: check it with its grader first"
                )

        cpu: dict[str, list[float]] = {name: [] for name in algorithms}

        def timed(
            name: str, tensor: torch.Tensor = tensor, cpu: dict[str, list[float]] = cpu
        ) -> Callable[[], float]:
            def run() -> float:  # one iteration, the slowest rank's seconds
                tensor.fill_(1.0)  # keep values finite for PRODUCT-free sums
                dist.barrier()
                cpu_start, start = time.process_time(), time.perf_counter()
                functions[name](tensor)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                # every thread of this process (gloo's too), user + system: the machine's work
                used = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                dist.all_reduce(used)
                cpu[name].append(float(used.item()))
                return float(elapsed.item())

            return run

        times = interleave(
            {name: timed(name) for name in algorithms}, iterations_for(nbytes, world, scale)
        )
        for name in algorithms:
            median = statistics.median(times[name])
            rows.append(
                Row(world, tensor.numel() * 4, name, median, len(times[name]), tuple(times[name]),
                    statistics.median(cpu[name]))
            )  # fmt: skip
    return rows if rank == 0 else []


def run_benchmark(
    worlds: Sequence[int],
    sizes: Sequence[int],
    algorithms: Sequence[str],
    *,
    impl: str = "solutions",
    nodes: int = 2,
    segment_bytes: int = 2 * MIB,
    scale: float = 1.0,
    timeout: float = 1800,
    meter: LoadMeter | None = None,
) -> list[Row]:
    """Every (world, size, algorithm) median, worlds one after the other (each world within
    ``timeout`` seconds); ``meter`` (course/verdicts.py) is told which worlds ran when."""
    known = ALGORITHMS + EXTRA_ALGORITHMS
    unknown = [a for a in algorithms if a not in known]
    if unknown:
        raise ValueError(f"unknown algorithms {unknown}: choose from {', '.join(known)}")
    bad = [w for w in worlds if w < 2 or w % nodes]
    if bad:
        raise ValueError(
            f"worlds {bad}: each world needs at least 2 ranks and must divide into --nodes "
            f"{nodes} simulated nodes of equal size"
        )
    rows: list[Row] = []
    meter = meter or LoadMeter()
    for world in worlds:
        with meter.running(processes=world):
            rows += run_world(
                measure_worker,
                world,
                (list(sizes), list(algorithms), impl, segment_bytes, scale),
                nodes=nodes,
                timeout=timeout,
                env={"DTFS_P2P_LEDGER": "0"},
            )[0]
    return rows


# ----------------------------------------------------------------------------- the model


def cost_of(algorithm: str, nbytes: float, world: int, nodes: int, impl: str) -> Any:
    """The alpha-beta counts the fit uses for one algorithm (gloo's all-reduce is a ring:
    gloo/allreduce.cc, ``ring``)."""
    model = load_impl(PHASE, "alpha_beta", impl)
    if algorithm == "halving_doubling":
        return model.halving_doubling_cost(nbytes, world)
    if algorithm == "hierarchical":  # the ring variants and gloo are costed as the ring
        inside, across = model.hierarchical_cost(nbytes, nodes, world // nodes)
        return inside + across
    return model.ring_cost(nbytes, world)


@dataclass(frozen=True)
class Fit:
    world: int
    algorithm: str
    alpha: float
    beta: float


def fit_models(rows: Sequence[Row], nodes: int, impl: str) -> list[Fit]:
    """alpha and beta per (world, algorithm), fitted to the medians."""
    model = load_impl(PHASE, "alpha_beta", impl)
    fits = []
    for world in sorted({r.world for r in rows}):
        for algorithm in ALGORITHMS + EXTRA_ALGORITHMS:
            mine = [r for r in rows if r.world == world and r.algorithm == algorithm]
            if len(mine) < 2:
                continue
            costs = [cost_of(algorithm, r.nbytes, world, nodes, impl) for r in mine]
            fitted = model.fit_alpha_beta(costs, [r.median_s for r in mine])
            fits.append(Fit(world, algorithm, fitted.alpha, fitted.beta))
    return fits


def _model_time(world: int, nodes: int, impl: str) -> Callable[[Fit], Callable[[float], float]]:
    """``time_of(fit)(S)``: the fitted model's seconds for S bytes."""

    def time_of(fit: Fit) -> Callable[[float], float]:
        return lambda s: cost_of(fit.algorithm, s, world, nodes, impl).time(fit.alpha, fit.beta)

    return time_of


def crossovers(fits: Sequence[Fit], nodes: int, impl: str) -> list[str]:
    """Sentences: where the fitted models of two algorithms predict equal times."""
    model = load_impl(PHASE, "alpha_beta", impl)
    lines = []
    for world in sorted({f.world for f in fits}):
        mine = [f for f in fits if f.world == world]
        for i, a in enumerate(mine):
            for b in mine[i + 1 :]:
                time_of = _model_time(world, nodes, impl)
                at = model.crossover_bytes(time_of(a), time_of(b))
                if at is None:
                    faster = a if time_of(a)(MIB) < time_of(b)(MIB) else b
                    lines.append(
                        f"world {world}: {a.algorithm} vs {b.algorithm}: no crossover, "
                        f"{faster.algorithm} is predicted faster at every size"
                    )
                    continue
                small = a if time_of(a)(at / 4) < time_of(b)(at / 4) else b
                large = b if small is a else a
                lines.append(
                    f"world {world}: {small.algorithm} faster below {human(at)}, "
                    f"{large.algorithm} above"
                )
    return lines


# ----------------------------------------------------------------------------- output


def human(nbytes: float) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def busbw_table(rows: Sequence[Row]) -> Table:
    """One row per (world, size, algorithm); the last column is busbw / dist.all_reduce's."""
    reference = {(r.world, r.nbytes): r for r in rows if r.algorithm == "dist.all_reduce"}
    table = Table(["world", "size", "algorithm", "median ms", "algbw GB/s", "busbw GB/s",
                   "busbw vs dist.all_reduce"])  # fmt: skip
    for r in rows:
        ref = reference.get((r.world, r.nbytes))
        ratio = f"{r.busbw / ref.busbw:.2f}x" if ref else "-"
        table.add(r.world, human(r.nbytes), r.algorithm, f"{1e3 * r.median_s:.3f}",
                  f"{r.algbw / 1e9:.3f}", f"{r.busbw / 1e9:.3f}", ratio)  # fmt: skip
    return table


def cpu_table(rows: Sequence[Row], min_bytes: int = 4 * MIB) -> Table:
    """Where the time goes at the large sizes: the CPU one call costs, all ranks together, and
    how many cores that keeps busy over its wall time. Every byte a rank sends or receives over
    loopback TCP is copied by a CPU (into the kernel and out of it), so when all cores are busy
    the wall time is the CPU work over the cores, and an algorithm can only be faster by doing
    less of it per byte (``CPU ns/byte``: per byte of the 2(n-1)/n·S each rank sends)."""
    table = Table(["world", "size", "algorithm", "median ms", "CPU ms (all ranks)",
                   "cores busy", "CPU ns/byte sent"])  # fmt: skip
    for r in rows:
        if r.nbytes < min_bytes or r.cpu_s <= 0:
            continue
        sent = 2 * (r.world - 1) * r.nbytes  # all ranks together
        table.add(r.world, human(r.nbytes), r.algorithm, f"{1e3 * r.median_s:.1f}",
                  f"{1e3 * r.cpu_s:.1f}", f"{r.cpu_s / r.median_s:.2f}",
                  f"{1e9 * r.cpu_s / sent:.2f}")  # fmt: skip
    return table


def format_table(rows: Sequence[Row]) -> str:
    """Markdown: one row per (world, size, algorithm); ratio = busbw / dist.all_reduce's."""
    return busbw_table(rows).to_markdown()


def fits_table(fits: Sequence[Fit]) -> Table:
    table = Table(["world", "algorithm", "alpha us", "beta ns/byte", "1/beta GB/s"])
    for f in fits:
        bandwidth = f"{1e-9 / f.beta:.3f}" if f.beta > 0 else "inf"
        table.add(f.world, f.algorithm, f"{1e6 * f.alpha:.1f}", f"{1e9 * f.beta:.3f}", bandwidth)
    return table


def format_fits(fits: Sequence[Fit]) -> str:
    return fits_table(fits).to_markdown()


def speed_goal(rows: Sequence[Row], load: Load | None = None) -> list[str]:
    """The ring's busbw at 16 and 64 MiB against dist.all_reduce's (goal: >= 0.95x), one line
    per cell: its verdict (course/verdicts.py) with the pairs' median and middle half."""
    return [v.line for v in goal_verdicts(rows, load)]


def save_plot(rows: Sequence[Row], fits: Sequence[Fit], path: Path, nodes: int, impl: str) -> None:
    """busbw against size, one panel per world; dashed lines are the fitted models."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r.world for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.2), squeeze=False)
    for ax, world in zip(axes[0], worlds, strict=True):
        for i, algorithm in enumerate(ALGORITHMS + EXTRA_ALGORITHMS):
            mine = [r for r in rows if r.world == world and r.algorithm == algorithm]
            if not mine:
                continue
            color = f"C{i}"
            ax.plot([r.nbytes for r in mine], [r.busbw / 1e9 for r in mine], "o-", color=color,
                    label=algorithm)  # fmt: skip
            fit = next((f for f in fits if f.world == world and f.algorithm == algorithm), None)
            if fit is not None:
                sizes = [r.nbytes for r in mine]
                model = [
                    s / cost_of(algorithm, s, world, nodes, impl).time(fit.alpha, fit.beta)
                    * 2 * (world - 1) / world / 1e9
                    for s in sizes
                ]  # fmt: skip
                ax.plot(sizes, model, "--", color=color, alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"world {world} (dashed: fitted alpha-beta model)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line


@dataclass
class BenchmarkConfig:
    """The benchmark's flags."""

    world: str = field(
        default="2,4",
        metadata={"help": f"world sizes 2..{MAX_WORLD}: --world 2 --world 4, or --world 2,4"},
    )
    min_kib: float = field(
        default=1.0,
        metadata={"help": "smallest message, KiB", "gt": 0, "fix": "a size in KiB, e.g. 1"},
    )
    max_mib: float = field(
        default=64.0,
        metadata={
            "help": "largest message, MiB",
            "gt": 0,
            "le": 1024,
            "fix": "a size in MiB up to 1024, e.g. 64",
        },
    )
    algorithms: str = field(
        default=",".join(ALGORITHMS),
        metadata={"help": f"from {', '.join(ALGORITHMS + EXTRA_ALGORITHMS)}"},
    )
    nodes: int = field(
        default=2,
        metadata={
            "help": "simulated nodes (hierarchical)",
            "ge": 1,
            "fix": "1 or more nodes that divide every world, e.g. 2",
        },
    )
    segment_kib: int = field(
        default=2048,
        metadata={"help": "ring segment size, KiB", "ge": 1, "fix": "e.g. 2048 (2 MiB)"},
    )
    repeat_scale: float = field(
        default=1.0,
        metadata={
            "help": "multiply the repeats by this",
            "gt": 0,
            "le": 100,
            "fix": "a factor such as 0.5 (quicker) or 2 (steadier)",
        },
    )
    impl: str = field(default="solutions", metadata={"choices": IMPLS, "help": "whose code"})
    json: str = field(default="", metadata={"help": "write the rows and fits to this file"})
    plot: str = field(default="benchmark_collectives.png", metadata={"help": "PNG ('' for none)"})
    record: str = field(
        default="", metadata={"help": "write the tables to this results file (course/results.py)"}
    )


def _merge_repeated(argv: Sequence[str], flag: str) -> list[str]:
    """``--world 2 --world 4`` -> ``--world 2,4`` (argparse keeps only the last otherwise)."""
    values, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag and i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return [*rest, flag, ",".join(values)] if values else rest


def validate(config: BenchmarkConfig) -> tuple[list[int], list[str], list[int]]:
    """The worlds, algorithms and sizes to run, or a ValueError naming the bad flag and a fix.

    Everything is checked here, before any process starts."""
    try:
        worlds = [int(w) for w in config.world.split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"--world {config.world!r}: give world sizes like 2 or 2,4") from None
    bad = [w for w in worlds if not 2 <= w <= MAX_WORLD or w % config.nodes]
    if not worlds or bad:
        raise ValueError(
            f"--world {config.world}: each world needs 2 to {MAX_WORLD} ranks and must divide "
            f"into --nodes {config.nodes} simulated nodes of equal size (e.g. --world 2,4)"
        )
    algorithms = [a.strip() for a in config.algorithms.split(",") if a.strip()]
    known = ALGORITHMS + EXTRA_ALGORITHMS
    unknown = [a for a in algorithms if a not in known]
    if not algorithms or unknown:
        raise ValueError(
            f"--algorithms {config.algorithms!r}: unknown {unknown or 'none given'}; choose from "
            f"{', '.join(known)}"
        )
    if config.max_mib * 1024 < config.min_kib:
        raise ValueError(
            f"--min-kib {config.min_kib:g} is above --max-mib {config.max_mib:g} (= "
            f"{config.max_mib * 1024:g} KiB): give a range such as --min-kib 1 --max-mib 64"
        )
    return worlds, algorithms, default_sizes(int(config.min_kib * KIB), int(config.max_mib * MIB))


def _range(values: Sequence[float], unit: str, digits: int = 2) -> str:
    low, high = min(values), max(values)
    if f"{low:.{digits}f}" == f"{high:.{digits}f}":
        return f"{low:.{digits}f}{unit}"
    return f"{low:.{digits}f}-{high:.{digits}f}{unit}"


GOAL = Goal("ring busbw / dist.all_reduce busbw", GOAL_RATIO)


def goal_pairs(rows: Sequence[Row]) -> dict[tuple[int, int], tuple[Row, Row, list[float]]]:
    """Per goal cell (world, bytes): the ring's row, dist.all_reduce's, and the busbw ratio of
    every iteration pair (dist.all_reduce's time / the ring's); rows without their iterations'
    times (an older results file) give the ratio of the medians alone."""
    reference = {(r.world, r.nbytes): r for r in rows if r.algorithm == "dist.all_reduce"}
    cells = {}
    for r in rows:
        ref = reference.get((r.world, r.nbytes))
        if r.algorithm == "ring" and ref and r.nbytes in GOAL_SIZES:
            if r.times and len(r.times) == len(ref.times):
                ratios = pair_ratios(ref.times, r.times)
            else:
                ratios = [r.busbw / ref.busbw]
            cells[(r.world, r.nbytes)] = (r, ref, ratios)
    return cells


def goal_verdicts(rows: Sequence[Row], load: Load | None = None) -> list[Verdict]:
    """Each goal cell judged (course/verdicts.py); ``load`` None: judged as on a quiet machine."""
    load = load or Load.quiet()
    return [
        GOAL.judge(ratios, load, cell=f"world {world}, {human(nbytes)}",
                   more="more repeats (--repeat-scale 2)")
        for (world, nbytes), (_, _, ratios) in goal_pairs(rows).items()
    ]  # fmt: skip


def goal_table(rows: Sequence[Row], load: Load | None = None) -> Table:
    """The ring's speed goal, cell by cell: busbw against dist.all_reduce's in the same run;
    the ratio is the median over the iteration pairs, the middle half their interquartile
    range, and the verdict course/verdicts.py's (``load`` None: as on a quiet machine)."""
    table = Table(["world", "size", "ring busbw GB/s", "dist.all_reduce busbw GB/s", "ratio",
                   "middle half", f"goal >= {GOAL_RATIO}x"])  # fmt: skip
    verdicts = goal_verdicts(rows, load)
    for ((world, nbytes), (r, ref, _)), verdict in zip(
        goal_pairs(rows).items(), verdicts, strict=True
    ):
        table.add(world, human(nbytes), f"{r.busbw / 1e9:.3f}", f"{ref.busbw / 1e9:.3f}",
                  f"{verdict.spread.median:.2f}x",
                  f"{verdict.spread.low:.3f}-{verdict.spread.high:.3f}x",
                  verdict.short)  # fmt: skip
    if load is not None:
        busy = "busy" if load.busy else "not busy"
        table.note = f"The machine during the run: {load.text()} ({busy})."
    return table


def summary_values(
    rows: Sequence[Row],
    fits: Sequence[Fit] | None,
    lines: Sequence[str],
    load: Load | None = None,
) -> dict[str, str]:
    """The figures a page quotes, computed from the rows (each a string, as printed):
    ``goal_met`` ("3 of 4": cells met), ``goal_verdicts`` ("3 met, 1 inconclusive (spread) of
    4"), ``load`` (the machine during the run), the ratios per cell and over sizes."""
    values: dict[str, str] = {}
    goal = goal_table(rows, load)
    if goal.rows:
        met = sum(row[-1] == "met" for row in goal.rows)
        values["goal_met"] = f"{met} of {len(goal.rows)}"
        values["goal_verdicts"] = tally(goal_verdicts(rows, load))
        if load is not None:
            values["load"] = f"{load.text()} ({'busy' if load.busy else 'not busy'})"
        values["goal_worst"] = min(goal.rows, key=lambda row: float(row[4][:-1]))[4]
        for row in goal.rows:
            values[f"goal_w{row[0]}_{row[1].replace(' ', '').lower()}"] = row[4]
            values[f"goal_w{row[0]}_{row[1].replace(' ', '').lower()}_middle"] = row[5]
        for goal_world in sorted({row[0] for row in goal.rows}):
            ratios = [float(row[4][:-1]) for row in goal.rows if row[0] == goal_world]
            values[f"ratio_goal_w{goal_world}"] = _range(ratios, "x")
    reference = {(r.world, r.nbytes): r for r in rows if r.algorithm == "dist.all_reduce"}
    for world in sorted({r.world for r in rows}):
        large = [r for r in rows if r.world == world and r.nbytes >= 4 * MIB]
        if large:
            values[f"large_busbw_w{world}"] = _range([r.busbw / 1e9 for r in large], " GB/s")
        for algorithm in sorted({r.algorithm for r in rows} - {"dist.all_reduce"}):
            ratios = [
                r.busbw / reference[(world, r.nbytes)].busbw
                for r in rows
                if r.world == world and r.algorithm == algorithm and r.nbytes >= 4 * MIB
                and (world, r.nbytes) in reference
            ]  # fmt: skip
            if ratios:
                values[f"ratio_large_w{world}.{algorithm}"] = _range(ratios, "x")
        measured = [r for r in large if r.cpu_s > 0]
        if measured:  # the cpu table's figures: how busy the cores were, the work per byte
            values[f"cores_busy_w{world}"] = _range([r.cpu_s / r.median_s for r in measured], "")
            for algorithm in sorted({r.algorithm for r in measured}):
                per_byte = [
                    1e9 * r.cpu_s / (2 * (world - 1) * r.nbytes)
                    for r in measured
                    if r.algorithm == algorithm
                ]
                values[f"cpu_ns_per_byte_w{world}.{algorithm}"] = _range(per_byte, " ns")
    del fits, lines  # the fits and crossovers are tables of their own
    return values


def record(
    path: str,
    rows: Sequence[Row],
    fits: Sequence[Fit] | None,
    lines: Sequence[str],
    load: Load | None = None,
) -> Path:
    """Write the tables and values of this run to a results file (course/results.py)."""
    tables = {"busbw": busbw_table(rows), "goal": goal_table(rows, load), "cpu": cpu_table(rows)}
    if fits is not None:
        tables["fits"] = fits_table(fits)
        crossings = Table(["prediction of the fitted models"])
        for line in lines:
            crossings.add(line)
        tables["crossovers"] = crossings
    return write_results(path, tables=tables, values=summary_values(rows, fits, lines, load))


def main(argv: Sequence[str] | None = None) -> int:
    args = _merge_repeated(list(sys.argv[1:] if argv is None else argv), "--world")
    config = parse_config(BenchmarkConfig, args, __doc__)
    try:
        worlds, wanted, sizes = validate(config)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    skipped = {a: why for a in wanted if (why := missing_for(a, config.impl))}
    algorithms = [a for a in wanted if a not in skipped]
    for algorithm, why in skipped.items():
        print(f"skipped {algorithm}: {why}")
    if not any(a != "dist.all_reduce" for a in algorithms):
        print("error: nothing of yours to measure yet: write 3.1 first", file=sys.stderr)
        return 2
    started = time.perf_counter()
    meter = LoadMeter()
    try:
        rows = run_benchmark(
            worlds, sizes, algorithms, impl=config.impl, nodes=config.nodes,
            segment_bytes=config.segment_kib * KIB, scale=config.repeat_scale, meter=meter,
        )  # fmt: skip
    except WorldError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    load = meter.read()
    print(format_table(rows))
    cpu = cpu_table(rows)
    if cpu.rows:
        print(f"\nCPU per call at 4 MiB and above ({os.cpu_count()} cores on this machine):\n")
        print(cpu.to_markdown())
    fit_missing = next(
        (why for module in FIT_NEEDS if (why := unwritten_todo(PHASE, module, config.impl))), None
    )
    fits: list[Fit] | None = None
    lines: list[str] = []
    if fit_missing:
        print(f"\nFitted alpha-beta model: skipped ({fit_missing})")
    else:
        fits = fit_models(rows, config.nodes, config.impl)
        lines = crossovers(fits, config.nodes, config.impl)
        print("\nFitted alpha-beta model (least squares relative to each median):\n")
        print(format_fits(fits))
        print("\nPredicted crossovers:")
        for line in lines:
            print(f"  {line}")
    goal = speed_goal(rows, load)
    if goal:
        print(f"\nSpeed goal (ring busbw >= {GOAL_RATIO}x dist.all_reduce at 16 and 64 MiB):")
        for line in goal:
            print(f"  {line}")
    if config.json:
        payload = {
            "rows": [r.as_dict() for r in rows],
            "fits": [asdict(f) for f in fits or []],
            "torch": torch.__version__,
            "backend": "gloo",
        }
        Path(config.json).write_text(json.dumps(payload, indent=1))
    if config.plot:
        save_plot(rows, fits or [], Path(config.plot), config.nodes, config.impl)
        print(f"\nplot: {config.plot}")
    if config.record:
        print(f"\nrecorded: {record(config.record, rows, fits, lines, load)}")
    print(f"\n({time.perf_counter() - started:.0f} s; torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    run_main(main)
