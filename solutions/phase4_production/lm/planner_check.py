"""The layout planner checked against reality: predicted and measured, layout by layout.

For each world size (4 and 8 ranks on this machine), one world does what ``sharding: auto`` does
under torchrun: it measures the rates (``lm.framework.rates_in_world``), and the planner
(``lm/planner.py``) ranks every legal layout of the language model from them; the same world then
runs a spread of those layouts (the planner's first choices, and layouts from the whole length of
its ranking), their steps interleaved round after round (``lm.benchmark``). It prints for each the
predicted and measured step time (a layout marked "(anchor)" is one an anchor step ran, predicted by
that step's measurement: ``Prediction.anchor``), the measured step over every rank's measured CPU
time divided by the cores (how much a shared machine leaves idle: the planner's model for ranks that
share cores takes it from the anchor steps that ran the layout's kinds, ``lm.anchors``), and bytes
held per rank (model states, and the activations autograd saved during a step), then three verdicts:

* the rank correlation (Spearman) between the predicted and the measured order of the layouts;
* whether the planner's first choice is the fastest layout measured or within 5% of it, judged
  round by round against the fastest (``course.verdicts``: met when the middle half of the
  rounds' ratios is within 5%, not met when it is wholly above on a quiet machine, else
  inconclusive);
* whether every layout's measured step is within 0.8-1.25x of its prediction: met, not met, or
  inconclusive when the machine itself moved between the rates and the layouts (data
  parallelism's anchor layout is always among the checked ones, and its CPU there is compared
  with its CPU among the anchors).

All three are stated as measured; the guide says where the model misses and why::

    uv run python -m solutions.phase4_production.lm.planner_check            # print
    uv run python -m solutions.phase4_production.lm.planner_check --record   # and record
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course.cli import benchmark_main, run_main
from course.results import Table, write_results
from course.verdicts import Goal, Load, LoadMeter, pair_ratios
from course.world import run_world
from phase4_production.lm_layout import ParallelSettings
from solutions.phase4_production.lm.benchmark import BenchConfig, measure_layouts
from solutions.phase4_production.lm.calibration import anchor_idle, calibration
from solutions.phase4_production.lm.framework_run import rates_in_world
from solutions.phase4_production.lm.planner import GIB, Machine, Prediction, plan
from solutions.phase4_production.lm.rates import Rates

RESULTS = Path(__file__).resolve().parents[3] / "phase4_production" / "results"
TOP_CHOICE = 1.05  # issue 40: the first choice the fastest measured, or within 5% of it
FIRST_CHOICE_GOAL = Goal("the first choice's step / the fastest layout's, round by round",
                         TOP_CHOICE, at_least=False)  # fmt: skip
TIME_BAND = (0.8, 1.25)  # issue 40: every measured / predicted step time inside this band
# the anchor layout's CPU among the checked layouts over its CPU among the anchors, a minute
# earlier in the same world: further from 1 than this, the machine itself moved, and a band
# missed is inconclusive rather than not met (a band held is still met)
DRIFT = 0.10


@dataclass
class CheckConfig(BenchConfig):
    """The benchmark's flags (9 rounds by default), plus how many layouts to measure per world."""

    layouts: int = field(default=8, metadata={"ge": 3, "le": 40, "fix": "e.g. 8"})
    # the top layouts lie within a few percent of each other: a median of 9 rounds, not 5
    rounds: int = field(default=9, metadata={"ge": 1, "le": 1000, "fix": "e.g. 9"})
    worlds: str = field(default="4,8", metadata={"help": "world sizes, comma separated"})


def spread(predictions: list[Prediction], count: int) -> list[Prediction]:
    """The planner's first three choices, then layouts evenly spaced along the rest of its
    ranking (the last one included), ``count`` in all (fewer when fewer fit)."""
    fitting = [p for p in predictions if p.fits]
    if len(fitting) <= count:
        return fitting
    chosen = fitting[:3]
    rest = fitting[3:]
    step = (len(rest) - 1) / max(1, count - 4)
    chosen += [rest[round(i * step)] for i in range(count - 3)]
    return chosen


def _options(settings: ParallelSettings) -> dict[str, Any]:
    names = ("dp", "cp", "tp", "pp", "ep", "sequence_parallel", "schedule", "microbatches",
             "chunks", "zero")  # fmt: skip
    return {name: getattr(settings, name) for name in names}


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Rank correlation of two sequences (average ranks for ties)."""

    def ranks(values: Sequence[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    mean = (n - 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb, strict=True))
    var = sum((x - mean) ** 2 for x in ra) ** 0.5 * sum((y - mean) ** 2 for y in rb) ** 0.5
    return cov / var if var else 0.0


def worlds_of(config: CheckConfig) -> list[int]:
    return [int(w) for w in config.worlds.split(",") if w.strip()]


def check(config: CheckConfig) -> None:
    problems = [f"--worlds {config.worlds}: 4 or 8" for w in worlds_of(config) if w not in (4, 8)]
    problems += [f"model: {p}" for p in config.model(False).problems()]
    if problems:
        raise ValueError("; ".join(problems))


@dataclass
class WorldCheck:
    world: int
    chosen: list[Prediction]
    rows: list[dict[str, Any]]  # rank 0's measured rows, in the order of ``chosen``
    activations: list[int]  # the busiest rank's measured activation peak, per layout
    cpu: list[float]  # every rank's median CPU seconds per step, summed, per layout
    rates: Rates  # measured for this world (its links in a world of its size)
    load: Load = field(default_factory=Load.quiet)  # the machine's other work around the world


def check_world(config: CheckConfig) -> tuple[Rates, list[Prediction], dict[str, Any]]:
    """On every rank of one world: what ``sharding: auto`` does under torchrun (the rates
    measured in this world, ``lm.framework.rates_in_world``, then the plan), and then, in the
    same processes a minute later rather than in another world, the spread of the plan's
    layouts timed round after round (``lm.benchmark.measure_layouts``). Rates measured in a
    world of their own had drifted from the checked world's by up to a fifth at 8 ranks (the
    anchor layout's CPU at 0.78x in the 2026-11-28 record), which is the machine's noise, not
    the model's."""
    model = config.model(False)
    world = dist.get_world_size()
    rates = rates_in_world(model, torch.float32, batch=config.batch)
    chosen: list[Any] = [None]
    if dist.get_rank() == 0:  # every rank runs the layouts rank 0 planned, in its order
        ranked = plan(model, rates, Machine(world, world, 16 * GIB), config.batch)
        chosen = [with_an_anchor(spread(ranked, config.layouts), ranked, rates, config.batch)]
    dist.broadcast_object_list(chosen, src=0)
    layouts = {p.settings.label(): (_options(p.settings), False) for p in chosen[0]}
    base = {f.name: getattr(config, f.name) for f in fields(BenchConfig)}
    bench = BenchConfig(**{**base, "world": world, "library": False})
    return rates, chosen[0], measure_layouts(bench, layouts, False)


def with_an_anchor(
    chosen: list[Prediction], ranked: list[Prediction], rates: Rates, batch: int
) -> list[Prediction]:
    """``chosen``, with data parallelism's anchor layout added at the end when no chosen layout
    is an anchor's (the same layout at the same batch): one layout measured both among the
    anchors and among the checked layouts tells how far the machine moved between the two
    (:func:`anchor_repeat`)."""
    anchors = {(a.settings.label(), a.sequences) for a in rates.anchors}
    if any((p.settings.label(), batch) in anchors for p in chosen):
        return chosen
    data_parallel = [a.settings.label() for a in rates.anchors if a.kind == "dp"]
    extra = [p for p in ranked if p.settings.label() in data_parallel and p.fits]
    return sorted(chosen + extra[:1], key=lambda p: p.seconds)  # the planner's order


def measure(config: CheckConfig) -> tuple[Rates, list[WorldCheck]]:
    out = []
    for world in worlds_of(config):
        meter = LoadMeter()
        with meter.running(processes=world):
            per_rank = run_world(check_world, world, (config,), {}, timeout=3600)
        rates, chosen, _ = per_rank[0]
        names = [p.settings.label() for p in chosen]
        rows = [per_rank[0][2][n] for n in names]
        peaks = [max(r[2][n]["activations"] for r in per_rank) for n in names]
        cpu = [sum(r[2][n]["cpu"] for r in per_rank) for n in names]
        out.append(WorldCheck(world, chosen, rows, peaks, cpu, rates, meter.read()))
    return out[-1].rates, out


def shared_rates(rates: Rates) -> dict[str, str]:
    """The rates the shared-core model used, and the anchors' calibration, as recorded values."""
    comm = rates.comm_cpu
    fitted = calibration(rates)
    return {
        "comm_cpu_per_round_us": f"{comm.alpha * 1e6:.0f}" if comm is not None else "-",
        "contention": f"{rates.contention:.2f}",
        "action_cpu_us": f"{rates.action_cpu * 1e6:.0f}",
        "common_scale": f"{fitted.common:.2f}",
        "tp_call_us": f"{fitted.extra.get('tp', 0.0) * 1e6:.0f}",
        "tp_round_us": f"{fitted.extra.get('tp_round', 0.0) * 1e6:.0f}",
        "tp_kib_us": f"{fitted.extra.get('tp_byte', 0.0) * 1024 * 1e6:.1f}",
        "cp_call_us": f"{fitted.extra.get('cp_call', 0.0) * 1e6:.0f}",
        "cp_pass_us": f"{fitted.extra.get('cp', 0.0) * 1e6:.0f}",
        "cp_kib_us": f"{fitted.extra.get('cp_byte', 0.0) * 1024 * 1e6:.1f}",
        "zero_kib_us": f"{fitted.extra.get('zero_byte', 0.0) * 1024 * 1e6:.1f}",
        "pp_step_us": f"{fitted.extra.get('pp_step', 0.0) * 1e6:.0f}",
        "pp_action_us": f"{fitted.extra.get('pp_action', 0.0) * 1e6:.0f}",
        "idle": f"{anchor_idle(rates):.2f}",
    }


def anchor_repeat(check_: WorldCheck, batch: int) -> tuple[str, float | None]:
    """For the first checked layout that is also an anchor (the same layout at the same batch,
    measured once among the anchors and once among the checked layouts, in the same world about
    a minute apart): its name and its CPU here over its CPU there, how far the machine moved
    between the rates and the measurement (the noise a prediction can at best match).
    ``("-", None)`` when none is."""
    anchors = {(a.settings.label(), a.sequences): a for a in check_.rates.anchors}
    for p, cpu in zip(check_.chosen, check_.cpu, strict=True):
        anchor = anchors.get((p.settings.label(), batch))
        if anchor is not None and anchor.cpu > 0:
            return p.settings.label(), cpu / anchor.cpu
    return "-", None


def band_verdict(low: float, high: float, drift: float | None) -> str:
    """``met`` when every measured / predicted ratio lies in :data:`TIME_BAND`; otherwise
    ``inconclusive (drift)`` when the anchor layout's CPU moved by more than :data:`DRIFT`
    between the rates and the layouts (or was not measured), else ``not met``."""
    if TIME_BAND[0] <= low and high <= TIME_BAND[1]:
        return "met"
    if drift is None or abs(drift - 1) > DRIFT:
        return "inconclusive (drift)"
    return "not met"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def report(result: tuple[Rates, list[WorldCheck]], config: CheckConfig) -> str:
    rates, checks = result
    text = []
    for check_ in checks:
        table = Table(["planner's rank", "layout", "predicted ms", "measured ms", "measured / "
                       "predicted", "measured / (all ranks' CPU / cores)",
                       "states MiB predicted / measured", "activations MiB "
                       "predicted / measured"])  # fmt: skip
        predicted, measured, wasted = [], [], []
        cores = check_.rates.cores
        for rank, (p, row, act, cpu) in enumerate(
            zip(check_.chosen, check_.rows, check_.activations, check_.cpu, strict=True), 1
        ):
            seconds = row["seconds"]
            predicted.append(p.seconds)
            measured.append(seconds)
            states = sum(row["held"])
            wasted.append(seconds / (cpu / cores))
            name = p.settings.label() + (" (anchor)" if p.anchor is not None else "")
            table.add(rank, name, f"{p.seconds * 1e3:.1f}", f"{seconds * 1e3:.1f}",
                      f"{seconds / p.seconds:.2f}x", f"{wasted[-1]:.2f}x",
                      f"{_mib(p.held.states)} / {_mib(states)}",
                      f"{_mib(p.held.activations)} / {_mib(act)}")  # fmt: skip
        rho = spearman(predicted, measured)
        fastest = min(measured)
        first = measured[0] / fastest
        quickest = check_.rows[measured.index(fastest)]
        choice = FIRST_CHOICE_GOAL.judge(
            pair_ratios(check_.rows[0]["times"], quickest["times"]), check_.load, per="round"
        )
        ratios = [m / p for m, p in zip(measured, predicted, strict=True)]
        low, high = min(ratios), max(ratios)
        repeated, drift = anchor_repeat(check_, config.batch)
        band = band_verdict(low, high, drift)
        moved = "not measured" if drift is None else f"{repeated} {drift:.2f}x"
        verdict = (
            f"world {check_.world}: rank correlation {rho:.2f}; the first choice measured "
            f"{first:.2f}x the fastest layout measured (within {(TOP_CHOICE - 1) * 100:.0f}%: "
            f"{choice.short}, middle half of the rounds {choice.spread.text('x')}); "
            f"measured / predicted {low:.2f}-{high:.2f}x ({band}: goal {TIME_BAND[0]:g}-"
            f"{TIME_BAND[1]:g}x for every layout; the anchor layout's CPU here over its CPU "
            f"among the anchors: {moved}, within {DRIFT:.0%} counts as the same machine)"
        )
        table.note = verdict
        values = {
            "rank_correlation": f"{rho:.2f}",
            "first_choice_ratio": f"{first:.2f}x",
            "first_choice_met": choice.short,
            "first_choice": check_.chosen[0].settings.label(),
            "fastest": check_.chosen[measured.index(fastest)].settings.label(),
            "time_ratios": f"{low:.2f}-{high:.2f}x",
            "time_band_met": band,
            "wall_over_cpu": f"{min(wasted):.2f}-{max(wasted):.2f}x",
            "anchor_repeat": moved,
            **shared_rates(check_.rates),
        }
        if config.record:
            write_results(RESULTS / f"lm_planner_w{check_.world}.json",
                          tables={"check": table}, values=values)  # fmt: skip
        text.append(f"{table.to_markdown()}\n\n{verdict}")
    sources = "; ".join(f"{k}: {v}" for k, v in rates.sources.items())
    return "\n\n".join(text) + f"\n\nrates ({sources})"


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(CheckConfig, argv, __doc__, validate=check, measure=measure,
                          report=report)  # fmt: skip


if __name__ == "__main__":
    run_main(main)
