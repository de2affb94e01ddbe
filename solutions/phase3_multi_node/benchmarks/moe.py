"""Benchmark of exercise 3.8: load balance over a short training run, and all-to-all's cost.

Two measurements, each in its own forked world (``run_world``; gloo on CPU, also where GPUs are:
the tables describe the algorithm, not a GPU's speed):

1. **Capacity and load balance.** One MoE layer (``--experts`` experts, top-``--k``) on an
   expert-parallel group of ``--ep`` ranks learns a regression task whose tokens come from
   ``--clusters`` clusters around a common offset, so that the freshly initialised router sends
   most tokens to a few experts. The same run (same seed, same data) is repeated for every
   ``--aux-coefs`` x ``--capacity-factors`` pair, and at a few steps the table records the
   busiest expert's load against its fair share (routed choices, before capacity), the share of
   choices dropped over capacity, the load-balancing loss, the task loss, and the bytes each
   rank's all-to-alls send to other ranks per step (forward and backward, from the dispatch
   plans: exact). All of it is computed, not timed: a re-run on any machine gives the same
   table.
2. **All-to-all next to all-reduce.** ``dist.all_to_all_single`` (even splits) and
   ``dist.all_reduce`` on the same tensor of S bytes per rank, interleaved, median of ``--reps``
   after a warm-up, the slowest rank's; the bandwidth model predicts all-to-all / all-reduce =
   ((n-1)/n S) / (2 (n-1)/n S) = 0.5 (a ring all-reduce moves twice what an all-to-all moves).
   Timed: provisional on a busy machine.

    uv run python -m solutions.phase3_multi_node.benchmarks.moe
    uv run python -m solutions.phase3_multi_node.benchmarks.moe --impl templates   # your code
    uv run python -m solutions.phase3_multi_node.benchmarks.moe \\
        --record phase3_multi_node/results/moe_balance.json
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.cli import parse_config, run_main
from course.impl import IMPLS, load_impl
from course.results import Table, write_results
from course.world import WorldError, run_world
from phase3_multi_node.moe_experts import MoEConfig, build_moe, check_moe_config
from phase3_multi_node.moe_layout import ExpertLayout

PHASE = "phase3_multi_node"
ELEMENT = 4  # float32


@dataclass
class BenchConfig:
    """The benchmark's flags."""

    ep: int = field(default=4, metadata={"ge": 2, "le": 8, "help": "expert-parallel ranks"})
    experts: int = field(default=8, metadata={"ge": 1})
    k: int = field(default=2, metadata={"ge": 1})
    hidden: int = field(default=16, metadata={"ge": 1})
    ffn_hidden: int = field(default=32, metadata={"ge": 1})
    tokens: int = field(default=128, metadata={"ge": 1, "help": "tokens per rank and step"})
    clusters: int = field(default=8, metadata={"ge": 1, "help": "clusters the tokens come from"})
    steps: int = field(default=60, metadata={"ge": 1})
    lr: float = field(default=0.01, metadata={"gt": 0, "fix": "a positive Adam learning rate"})
    aux_coefs: str = field(default="0,0.01,0.1", metadata={"help": "comma-separated, >= 0"})
    capacity_factors: str = field(default="1.0,1.25", metadata={"help": "comma-separated, > 0"})
    seed: int = 0
    a2a_worlds: str = field(default="2,4", metadata={"help": "worlds of the timing, 2..8"})
    a2a_kib: str = field(default="64,1024,8192", metadata={"help": "bytes per rank, KiB"})
    reps: int = field(default=10, metadata={"ge": 1, "le": 1000})
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference or your phase3 templates"},
    )
    record: str = field(
        default="", metadata={"help": "also write the tables to this results file (JSON)"}
    )

    @property
    def moe(self) -> MoEConfig:
        return MoEConfig(self.hidden, self.ffn_hidden, self.experts, self.k, 1.0)


EXAMPLES = {
    "aux-coefs": "0,0.01",
    "capacity-factors": "1.0,1.25",
    "a2a-worlds": "2,4",
    "a2a-kib": "64,1024",
}


def _numbers(flag: str, text: str, kind: type, low: float, strict: bool) -> list[Any]:
    try:
        values = [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    bad = [v for v in values if not math.isfinite(v) or (v <= low if strict else v < low)]
    if not values or bad:
        sign = ">" if strict else ">="
        raise ValueError(
            f"--{flag} {text!r}: give comma-separated numbers {sign} {low:g}, e.g. "
            f"--{flag} {EXAMPLES[flag]}"
        )
    return values


def validate(config: BenchConfig) -> None:
    """Every bad setting at once, before any process starts."""
    problems = []
    lists = (
        ("aux-coefs", config.aux_coefs, float, 0.0, False),
        ("capacity-factors", config.capacity_factors, float, 0.0, True),
        ("a2a-worlds", config.a2a_worlds, int, 1, True),
        ("a2a-kib", config.a2a_kib, int, 0, True),
    )
    for flag, text, kind, low, strict in lists:
        try:
            values = _numbers(flag, text, kind, low, strict)
            if flag == "a2a-worlds" and max(values) > 8:
                problems.append(f"--a2a-worlds {text!r}: at most 8 ranks on one machine")
        except ValueError as err:
            problems.append(str(err))
    try:
        check_moe_config(config.moe, config.ep)
    except ValueError as err:
        problems.append(str(err))
    if problems:
        raise ValueError("; ".join(problems))


# ----------------------------------------------------------------------------- the balance runs


def _task(config: BenchConfig, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens at ``step``: clusters around a common offset; each cluster's
    targets are its own random linear map of the tokens (so experts can specialise)."""
    g = torch.Generator().manual_seed(config.seed)
    h = config.hidden
    centers = torch.randn(config.clusters, h, generator=g)
    offset = torch.randn(h, generator=g)
    maps = torch.randn(config.clusters, h, h, generator=g) / h**0.5
    draw = torch.Generator().manual_seed(config.seed * 100_003 + step * 64 + rank + 1)
    cluster = torch.randint(config.clusters, (config.tokens,), generator=draw)
    x = offset + centers[cluster] + 0.3 * torch.randn(config.tokens, h, generator=draw)
    return x, torch.einsum("ti,tij->tj", x, maps[cluster])


def checkpoints(steps: int) -> list[int]:
    return sorted({0, steps // 4, steps // 2, steps - 1})


def _plan_bytes(plan: Any, me: int, config: BenchConfig) -> int:
    """Bytes this rank's all-to-alls send to other ranks in one step (forward and backward)."""
    out = sum(n for j, n in enumerate(plan.send_splits) if j != me)
    back = sum(n for j, n in enumerate(plan.recv_splits) if j != me)
    counts = (config.ep - 1) * (config.experts // config.ep) * 8
    return counts + 2 * (out + back) * config.hidden * ELEMENT


def balance_worker(config: BenchConfig) -> list[dict[str, Any]]:
    """Every (aux coefficient, capacity factor) run on this rank; rank 0's view returned."""
    ep_mod = load_impl(PHASE, "expert_parallel", config.impl)
    layout = ExpertLayout.build(ep=config.ep, dp=1)
    rank = dist.get_rank()
    runs = []
    marks = checkpoints(config.steps)
    for factor in _numbers("capacity-factors", config.capacity_factors, float, 0.0, True):
        for coef in _numbers("aux-coefs", config.aux_coefs, float, 0.0, False):
            moe = MoEConfig(config.hidden, config.ffn_hidden, config.experts, config.k, factor)
            layer = ep_mod.MoELayer(build_moe(moe, seed=config.seed), layout.ep_group)
            optimizer = torch.optim.Adam(layer.parameters(), lr=config.lr)
            rows = []
            for step in range(config.steps):
                x, target = _task(config, step, rank)
                output, aux = layer(x)
                loss = F.mse_loss(output, target)
                optimizer.zero_grad(set_to_none=True)
                (loss + coef * aux).backward()
                ep_mod.sync_moe_gradients(layer, layout)
                optimizer.step()
                if step not in marks:
                    continue
                last = layer.last
                sent = _plan_bytes(last.plan, rank, config)
                sums = torch.tensor(
                    [float(loss.detach()), float(aux.detach()), sent], dtype=torch.float64
                )
                dist.all_reduce(sums)
                sums /= config.ep
                routed = last.census.sum(dim=0).cpu()
                rows.append(
                    {
                        "step": step,
                        "routed": routed.tolist(),
                        "capacity": last.capacity,
                        "dropped": int((routed - last.capacity).clamp(min=0).sum()),
                        "loss": float(sums[0]),
                        "aux": float(sums[1]),
                        "bytes": float(sums[2]),
                    }
                )
            runs.append({"coef": coef, "factor": factor, "rows": rows})
    dist.barrier()
    return runs


# ----------------------------------------------------------------------------- the timing


def timing_worker(sizes: list[int], reps: int) -> list[tuple[int, float, float]]:
    """(bytes per rank, all_to_all ms, all_reduce ms): slowest rank's median of ``reps``."""
    n = dist.get_world_size()
    results = []
    for size in sizes:
        numel = max(n, size // ELEMENT // n * n)
        data = torch.randn(numel)
        out = torch.empty_like(data)
        times: dict[str, list[float]] = {"a2a": [], "ar": []}
        for rep in range(reps + 2):
            for name in ("a2a", "ar"):
                work = data.clone()
                dist.barrier()
                started = time.perf_counter()
                if name == "a2a":
                    dist.all_to_all_single(out, work)
                else:
                    dist.all_reduce(work)
                elapsed = time.perf_counter() - started
                if rep >= 2:
                    times[name].append(elapsed)
        medians = torch.tensor([statistics.median(times["a2a"]), statistics.median(times["ar"])])
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
        results.append((numel * ELEMENT, 1e3 * float(medians[0]), 1e3 * float(medians[1])))
    return results


# ----------------------------------------------------------------------------- report


def _kib(nbytes: float) -> str:
    return f"{nbytes / 1024:.0f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.0f} MiB"


def tables(
    config: BenchConfig,
    runs: list[dict[str, Any]],
    timings: dict[int, list[tuple[int, float, float]]],
) -> tuple[dict[str, Table], dict[str, str]]:
    fair = config.ep * config.tokens * config.k / config.experts
    balance = Table(
        [
            "aux coefficient",
            "capacity factor",
            "step",
            "busiest expert / fair share",
            "choices dropped",
            "aux loss",
            "task loss",
            "all-to-all KiB per rank and step",
        ],
        note=(
            f"{config.experts} experts, k={config.k}, ep={config.ep} ranks x {config.tokens} "
            f"tokens ({fair:g} choices per expert is the fair share), {config.clusters} "
            f"clusters, Adam lr {config.lr}, {config.steps} steps, seed {config.seed}."
        ),
    )
    final = Table(["aux coefficient", "capacity factor", "choices per expert, last step"])
    values: dict[str, str] = {"steps": str(config.steps)}
    last_drop: dict[tuple[float, float], float] = {}
    for run in runs:
        coef, factor = run["coef"], run["factor"]
        for row in run["rows"]:
            routed = row["routed"]
            share = max(routed) / fair
            dropped = row["dropped"] / sum(routed)
            balance.add(
                f"{coef:g}",
                f"{factor:g}",
                row["step"],
                f"{share:.2f}x",
                f"{100 * dropped:.1f}%",
                f"{row['aux']:.3f}",
                f"{row['loss']:.4f}",
                f"{row['bytes'] / 1024:.1f}",
            )
        end = run["rows"][-1]
        final.add(f"{coef:g}", f"{factor:g}", str(end["routed"]))
        last_drop[(coef, factor)] = end["dropped"] / sum(end["routed"])
        key = f"cf{factor:g}_aux{coef:g}".replace(".", "p")
        values[f"drop_last_{key}"] = f"{100 * last_drop[(coef, factor)]:.1f}%"
        first = run["rows"][0]
        values[f"drop_first_{key}"] = f"{100 * first['dropped'] / sum(first['routed']):.1f}%"
    coefs = sorted({c for c, _ in last_drop})
    factors = sorted({f for _, f in last_drop})
    if len(coefs) > 1:
        fewer = sum(last_drop[(coefs[-1], f)] < last_drop[(coefs[0], f)] for f in factors)
        values["aux_fewer_drops"] = (
            f"{fewer} of {len(factors)} capacity factors (aux {coefs[-1]:g} against {coefs[0]:g})"
        )
    cost = Table(
        [
            "world",
            "bytes per rank",
            "all_to_all_single ms",
            "all_reduce ms",
            "all-to-all / all-reduce",
            "bandwidth model",
        ]
    )
    ratios = []
    for world, rows in sorted(timings.items()):
        for nbytes, a2a, ar in rows:
            ratio = a2a / ar if ar > 0 else float("nan")
            ratios.append(ratio)
            cost.add(world, _kib(nbytes), f"{a2a:.3f}", f"{ar:.3f}", f"{ratio:.2f}x", "0.50x")
    if ratios:
        values["a2a_ratio_span"] = f"{min(ratios):.2f}x-{max(ratios):.2f}x"
        largest = [a / r for w, rows in timings.items() for n, a, r in rows[-1:] if r > 0]
        values["a2a_ratio_largest"] = (
            f"{min(largest):.2f}x-{max(largest):.2f}x" if largest else "n/a"
        )
    return {"balance": balance, "final": final, "cost": cost}, values


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(BenchConfig, argv, __doc__)
    try:
        validate(config)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    sizes = [kib * 1024 for kib in _numbers("a2a-kib", config.a2a_kib, int, 0, True)]
    try:
        runs = run_world(balance_worker, config.ep, (config,), timeout=900, backend="gloo")[0]
        timings = {
            world: run_world(
                timing_worker, world, (sizes, config.reps), timeout=900, backend="gloo"
            )[0]
            for world in _numbers("a2a-worlds", config.a2a_worlds, int, 1, True)
        }
    except WorldError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    made, values = tables(config, runs, timings)
    seconds = time.perf_counter() - started
    for name, table in made.items():
        print(f"\n{name}:\n\n{table.to_markdown()}")
        if table.note:
            print(f"\n{table.note}")
    print(f"\n({seconds:.0f} s; torch {torch.__version__})")
    if config.record:
        values["seconds"] = f"{seconds:.0f} s"
        path = write_results(config.record, tables=made, values=values)
        print(f"recorded {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
