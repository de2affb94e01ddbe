"""Benchmark DDP from scratch against torch's DistributedDataParallel, in the same run.

The model is an MLP of a few wide Linear layers (default 4 x 2048 x 2048: 64 MiB of fp32
gradients, so the default 25 MiB buckets give several all-reduces). Each timed quantity is the
slowest rank's time (ranks start together after a barrier), and the table shows medians over
``--steps`` repetitions, ours and torch's measured alternately so drift hits both alike:

* **step**: zero_grad, forward, backward (with the gradient averaging inside it), SGD step;
* **fwd+bwd**: forward and backward under DDP (returns once every gradient is averaged);
* **local fwd+bwd**: the same on the bare module, no communication at all;
* **comm alone**: the same buckets all-reduced with nothing else running.

The share of communication hidden behind backward is ``(local + comm - fwd+bwd) / comm``: 100%
when DDP costs no more than backward alone, 0% when it costs backward plus all the communication
(clipped to [0, 100]).

The goal (a step with ours at most 1.05x torch's) is judged per cap from the ratio of each
repetition's pair of steps (ours i against torch's i), by ``course/verdicts.py``'s rule: met
when the middle half of those ratios is within 1.05x, not met when it is all above on a machine
that is not busy, inconclusive otherwise; the 1-minute load around the run is read with it.

    uv run python -m solutions.phase3_multi_node.benchmarks.ddp
    uv run python -m solutions.phase3_multi_node.benchmarks.ddp --caps=1,5,25,100  # cost model
    uv run python -m solutions.phase3_multi_node.benchmarks.ddp --impl templates
    uv run python -m solutions.phase3_multi_node.benchmarks.ddp --caps=-1,1,5,100 \
        --record phase3_multi_node/results/ddp.json

``--record PATH`` writes the table and the figures the guide quotes (course/results.py).
``uv run python -m tests.bench 3.4`` measures your DDP against the guide's goal.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course.cli import benchmark_main, run_main
from course.impl import IMPLS, load_impl
from course.results import Table, write_results
from course.verdicts import Goal, Load, LoadMeter, Verdict, interleave, pair_ratios, tally
from course.world import run_world

PHASE = "phase3_multi_node"


@dataclass
class BenchmarkConfig:
    """The benchmark's flags."""

    world: int = field(
        default=2,
        metadata={"help": "number of ranks", "ge": 2, "le": 32, "fix": "2 to 32 ranks, e.g. 2"},
    )
    width: int = field(
        default=2048,
        metadata={
            "help": "width of each Linear layer",
            "ge": 1,
            "le": 16384,
            "fix": "a width from 1 to 16384, e.g. 2048",
        },
    )
    layers: int = field(
        default=4,
        metadata={
            "help": "number of width x width Linear layers",
            "ge": 1,
            "le": 64,
            "fix": "1 to 64 layers, e.g. 4",
        },
    )
    batch: int = field(
        default=32,
        metadata={
            "help": "samples per rank per step",
            "ge": 1,
            "le": 65536,
            "fix": "a batch of at least 1 sample, e.g. 32",
        },
    )
    steps: int = field(
        default=20,
        metadata={
            "help": "timed repetitions of each quantity",
            "ge": 1,
            "le": 10000,
            "fix": "at least 1 repetition, e.g. 20",
        },
    )
    caps: str = field(
        default="-1",
        metadata={
            "help": "bucket_cap_mb values, comma-separated (--caps=-1,5); -1: torch's default"
        },
    )
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "time the reference or your templates"},
    )
    record: str = field(
        default="", metadata={"help": "write the table to this results file (course/results.py)"}
    )


def parse_caps(text: str) -> list[float]:
    """``"-1,5,25"`` -> ``[-1.0, 5.0, 25.0]``; a ValueError naming what is not a number."""
    try:
        caps = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"--caps {text!r}: give sizes in MiB like -1,5,25") from None
    if not caps or any(cap < 0 and cap != -1 for cap in caps):
        raise ValueError(f"--caps {text!r}: sizes must be >= 0, or -1 for torch's default")
    return caps


def validate(config: BenchmarkConfig) -> None:
    """What the field bounds cannot say: the caps (parse_caps names what is wrong)."""
    parse_caps(config.caps)


def make_mlp(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - start)


def measure_worker(config: BenchmarkConfig, cap_mb: float) -> dict[str, Any]:
    """Runs on every rank; every rank returns the same medians (seconds), and under
    ``"samples"`` every repetition's seconds of each quantity, in order."""
    ddp_impl = load_impl(PHASE, "ddp", config.impl)
    cap = None if cap_mb < 0 else cap_mb
    ours = ddp_impl.DistributedDataParallel(make_mlp(config.width, config.layers), cap)
    models: dict[str, nn.Module] = {
        "ours": ours,
        "torch": TorchDDP(make_mlp(config.width, config.layers), bucket_cap_mb=cap),
    }
    local = make_mlp(config.width, config.layers)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-4) for name, m in models.items()}
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(config.batch, config.width, generator=g)
    buffers = [torch.zeros_like(b.buffer) for b in ours.buckets]

    def step(name: str) -> None:
        optimizers[name].zero_grad(set_to_none=True)
        models[name](x).square().mean().backward()
        optimizers[name].step()

    def forward_backward(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()

        return run

    def communicate() -> None:
        works = [dist.all_reduce(b, async_op=True) for b in buffers]
        for work in works:
            work.wait()

    for _ in range(2):  # warm-up; torch rebuilds its buckets after the first iteration
        for name in models:
            step(name)

    def timing(fn: Callable[[], Any]) -> Callable[[], float]:
        return lambda: timed(fn)

    # one repetition of each, in this order: step ours, step torch, fb ours, fb torch, local, comm
    runs = {f"step {name}": timing(functools.partial(step, name)) for name in models}
    runs |= {f"fb {name}": timing(forward_backward(model)) for name, model in models.items()}
    runs["local"] = timing(forward_backward(local))
    runs["comm"] = timing(communicate)
    samples = interleave(runs, config.steps)
    result: dict[str, Any] = {key: statistics.median(v) for key, v in samples.items()}
    result["samples"] = samples
    result["buckets"] = [b.nbytes for b in ours.buckets]
    result["grad_bytes"] = sum(p.numel() * p.element_size() for p in local.parameters())
    result["threads"] = torch.get_num_threads()
    result["cap"] = "default" if cap is None else f"{cap:g} MiB"
    return result


def hidden_share(fwd_bwd: float, local: float, comm: float) -> float:
    """Share of the communication time that backward hid: (local + comm - fwd_bwd) / comm."""
    if comm <= 0:
        return 0.0
    return min(1.0, max(0.0, (local + comm - fwd_bwd) / comm))


GOAL_RATIO = 1.05  # the guide's goal: our step time at most 1.05x torch DDP's


def header(results: Sequence[dict[str, Any]], config: BenchmarkConfig) -> str:
    first = results[0]
    return (
        f"MLP {config.layers} x Linear({config.width}, {config.width}), fp32, "
        f"{first['grad_bytes'] / 2**20:.1f} MiB of gradients, world {config.world}, batch "
        f"{config.batch} per rank, medians of {config.steps} (slowest rank), CPU "
        f"({first['threads']} thread(s) per rank)"
    )


GOAL = Goal("step time, your DDP / torch DDP", GOAL_RATIO, at_least=False)


def step_pair_ratios(result: dict[str, Any]) -> list[float]:
    """Our step time over torch DDP's, one per repetition pair (the ratio of the medians for a
    result without its samples)."""
    samples = result.get("samples")
    if samples:
        return pair_ratios(samples["step ours"], samples["step torch"])
    return [result["step ours"] / result["step torch"]]


def run_load(results: Sequence[dict[str, Any]]) -> Load | None:
    """The load around the run (``measure`` keeps it with each result), or None."""
    return results[0].get("load") if results else None


def goal_verdicts(results: Sequence[dict[str, Any]]) -> list[Verdict]:
    """Each cap judged against the goal (course/verdicts.py); without a load reading, as on a
    quiet machine."""
    load = run_load(results) or Load.quiet()
    return [
        GOAL.judge(step_pair_ratios(r), load, cell=f"bucket_cap_mb {r['cap']}", per="step pair")
        for r in results
    ]


def ddp_table(results: Sequence[dict[str, Any]], impl: str) -> Table:
    table = Table(
        ["bucket_cap_mb", "buckets (MiB)", "DDP", "step ms", "step vs torch", "middle half",
         f"goal <= {GOAL_RATIO}x", "fwd+bwd ms", "local fwd+bwd ms", "comm alone ms",
         "comm hidden behind backward"]
    )  # fmt: skip
    for r, verdict in zip(results, goal_verdicts(results), strict=True):
        buckets = ", ".join(f"{b / 2**20:.1f}" for b in r["buckets"])
        spread = verdict.spread
        for name, label in (("ours", f"from scratch ({impl})"), ("torch", "torch DDP")):
            hidden = hidden_share(r[f"fb {name}"], r["local"], r["comm"])
            ours = name == "ours"
            table.add(
                r["cap"], buckets, label, f"{1e3 * r[f'step {name}']:.1f}",
                f"{spread.median:.3f}x" if ours else "1.000x",
                f"{spread.low:.3f}-{spread.high:.3f}x" if ours else "-",
                verdict.short if ours else "-", f"{1e3 * r[f'fb {name}']:.1f}",
                f"{1e3 * r['local']:.1f}", f"{1e3 * r['comm']:.1f}", f"{100 * hidden:.0f}%",
            )  # fmt: skip
    load = run_load(results)
    if load is not None:
        table.note = (
            "step vs torch: the median of the repetitions' pairs; middle half: their "
            f"interquartile range. The machine during the run: {load.text()} "
            f"({'busy' if load.busy else 'not busy'})."
        )
    return table


def step_ratios(results: Sequence[dict[str, Any]]) -> list[float]:
    """Our step time over torch DDP's, one per cap: the median over the repetition pairs."""
    return [statistics.median(step_pair_ratios(r)) for r in results]


def summary_values(results: Sequence[dict[str, Any]]) -> dict[str, str]:
    ratios = step_ratios(results)
    verdicts = goal_verdicts(results)
    met = sum(v.outcome == "met" for v in verdicts)
    hidden = {
        name: [hidden_share(r[f"fb {name}"], r["local"], r["comm"]) for r in results]
        for name in ("ours", "torch")
    }
    return {
        "step_ratio_range": f"{min(ratios):.2f}-{max(ratios):.2f}x",
        "goal_met": f"{met} of {len(ratios)}",
        "goal_verdicts": tally(verdicts),
        "hidden_ours": f"{100 * min(hidden['ours']):.0f}-{100 * max(hidden['ours']):.0f}%",
        "hidden_torch": f"{100 * min(hidden['torch']):.0f}-{100 * max(hidden['torch']):.0f}%",
    }


def format_table(results: Sequence[dict[str, Any]], config: BenchmarkConfig) -> str:
    text = header(results, config) + "\n\n" + ddp_table(results, config.impl).to_markdown()
    if config.record:
        path = write_results(
            config.record,
            tables={"ddp": Table(["setup"], [[header(results, config)]]),
                    "steps": ddp_table(results, config.impl)},
            values=summary_values(results),
        )  # fmt: skip
        text += f"\n\nrecorded: {path}"
    return text


def measure(config: BenchmarkConfig) -> Any:
    """One world per cap; each result also holds the load around the whole run (``"load"``)."""
    meter = LoadMeter()
    results = []
    for cap in parse_caps(config.caps):
        with meter.running(processes=config.world):
            results.append(
                run_world(measure_worker, config.world, (config, cap), {}, timeout=900)[0]
            )
    load = meter.read()
    for result in results:
        result["load"] = load
    return results


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(
        BenchmarkConfig, argv, __doc__, validate=validate, measure=measure, report=format_table
    )


if __name__ == "__main__":
    run_main(main)
