"""What notebooks/lm_layouts.ipynb draws and says, read from the recorded results files.

The notebook runs nothing: every series it plots and every sentence it prints comes from the
results files the language model's programs recorded (``phase4_production/results/``):

* ``lm_layouts.json`` (``lm.benchmark``): tokens/s of each layout in a world of 4, the course's
  composition and the library's played in the same rounds; the bytes each rank held (measured:
  parameters, gradients and optimizer state, and the peak of the activations autograd saved);
  rank 0's bytes per step by group, counted by ``CommCounter``, and how far every rank's count
  was from ``lm.traffic``'s formulas;
* ``lm_planner_w4.json``, ``lm_planner_w8.json`` (``lm.planner_check``): the planner's predicted
  step time and bytes per rank beside the measured ones;
* ``lm_70b.json`` (``lm.worked_example``): a 70B-class model on 1,024 GPUs, computed, not
  measured;
* ``lm_gpu.json`` (``lm.throughput``): one rank on one GPU, beside PyTorch.

The ``*_lines`` functions return the sentences the notebook prints, computed from those files;
``tests/test_lm_notebook_claims.py`` computes them again and compares them with the notebook's
committed outputs. Every function takes the results folder, so a test can hand it another one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from course.results import load_results
from solutions.phase4_production.lm.planner_check import spearman

RESULTS = Path(__file__).resolve().parents[3] / "phase4_production" / "results"
LIBRARY = "library "  # the benchmark's prefix of the library composition's rows
CHOICE = "planner's choice: "  # and of the planner's choice

# ----------------------------------------------------------------------------- reading


def load(name: str, results: Path = RESULTS) -> dict[str, Any]:
    """One results file (``lm_layouts`` or ``lm_layouts.json``) of ``results``."""
    return load_results(results / (name if name.endswith(".json") else f"{name}.json"))


def rows(data: dict[str, Any], table: str) -> list[dict[str, str]]:
    """The rows of one recorded table, each a dict by column title."""
    recorded = data["tables"][table]
    return [dict(zip(recorded["columns"], row, strict=True)) for row in recorded["rows"]]


NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")  # 1,279.2 or 0.75


def numbers(cell: str) -> list[float]:
    """Every number of a cell, in order: ``"51.6 (45.6-55.7)"`` -> [51.6, 45.6, 55.7]."""
    return [float(x.replace(",", "")) for x in NUMBER.findall(cell)]


def number(cell: str) -> float:
    """The first number of a cell: ``"39,700"``, ``"1.05x"``, ``"18%"``, ``"24.5 s"``."""
    found = numbers(cell)
    if not found:
        raise ValueError(f"no number in {cell!r}")
    return found[0]


def _world(data: dict[str, Any]) -> int:
    return int(data["values"]["world"])


# ----------------------------------------------------------------------------- 1. tokens/s


@dataclass(frozen=True)
class Throughput:
    """One layout's tokens/s in the benchmark: the median round and its slowest and fastest
    rounds (the same tokens over the round's step time)."""

    layout: str
    composition: str  # "course" or "library"
    tokens_per_second: float
    slowest: float  # tokens/s of the slowest round
    fastest: float  # of the fastest round
    step_ms: float


def throughputs(results: Path = RESULTS) -> list[Throughput]:
    """Every row of the benchmark's layouts table (the planner's choice included)."""
    data = load("lm_layouts", results)
    out = []
    for row in rows(data, f"layouts_w{_world(data)}"):
        median, low, high = numbers(row["step ms (min-max)"])
        tokens = number(row["tokens/s"])
        library = row["layout"].startswith(LIBRARY)
        out.append(Throughput(
            row["layout"].removeprefix(LIBRARY), "library" if library else "course", tokens,
            tokens * median / high, tokens * median / low, median,
        ))  # fmt: skip
    return out


def pair(series: Sequence[Throughput]) -> list[tuple[Throughput, Throughput | None]]:
    """Each course layout (the planner's choice left out: it repeats a layout) with the
    library's run of it, where the library ran it."""
    library = {t.layout: t for t in series if t.composition == "library"}
    return [
        (t, library.get(t.layout))
        for t in series
        if t.composition == "course" and not t.layout.startswith(CHOICE)
    ]


@dataclass(frozen=True)
class Versus:
    """A layout both compositions ran: the course's tokens/s over the library's, round by round
    (median and the middle half of the rounds), and the recorded verdict."""

    layout: str
    ratio: float
    low: float
    high: float
    verdict: str


def versus(results: Path = RESULTS) -> list[Versus]:
    data = load("lm_layouts", results)
    out = []
    for row in rows(data, f"vs_library_w{_world(data)}"):
        ratio, low, high = numbers(row["course / library (middle half of the rounds)"])
        out.append(Versus(row["layout"], ratio, low, high, row["verdict (goal >= 1.0x)"]))
    return out


def throughput_lines(results: Path = RESULTS) -> list[str]:
    """The benchmark's world and rounds; the fastest and slowest course layouts; each layout
    the library ran too: the ratio, its middle half, the verdict; whether the two compositions'
    rounds overlap."""
    data = load("lm_layouts", results)
    series = throughputs(results)
    pairs = pair(series)
    course = [t for t, _ in pairs]
    fastest = max(course, key=lambda t: t.tokens_per_second)
    slowest = min(course, key=lambda t: t.tokens_per_second)
    lines = [
        f"world {_world(data)}, {data['values']['rounds']} interleaved rounds; the course's "
        f"fastest layout: {fastest.layout} ({fastest.tokens_per_second:,.0f} tokens/s), its "
        f"slowest: {slowest.layout} ({slowest.tokens_per_second:,.0f} tokens/s, "
        f"{fastest.tokens_per_second / slowest.tokens_per_second:.1f}x fewer)",
    ]
    for v in versus(results):
        lines.append(
            f"{v.layout}: the course's composition / the library's {v.ratio:.2f}x (middle half "
            f"of the rounds {v.low:g}-{v.high:g}x), goal >= 1.0x: {v.verdict}"
        )
    both = [(t, lib) for t, lib in pairs if lib is not None]
    apart = [t.layout for t, lib in both if t.slowest > lib.fastest or lib.slowest > t.fastest]
    ahead = sum(t.tokens_per_second > lib.tokens_per_second for t, lib in both)
    lines.append(
        f"the course's median is above the library's in {ahead} of the {len(both)} layouts both "
        f"ran; their ranges of rounds do not overlap in {len(apart)}"
        + (f" ({', '.join(apart)})" if apart else "")
    )
    return lines


@dataclass(frozen=True)
class GpuRun:
    """One row of the one-GPU throughput table."""

    step: str
    precision: str
    tokens_per_second: float
    mfu: float  # percent


def gpu_runs(results: Path = RESULTS) -> list[GpuRun]:
    data = load("lm_gpu", results)
    return [
        GpuRun(row["step"], row["precision"], number(row["tokens/s"]), number(row["MFU"]))
        for row in rows(data, "throughput")
    ]


def gpu_lines(results: Path = RESULTS) -> list[str]:
    """Each run on one GPU over PyTorch's own float32 step, and the device."""
    data = load("lm_gpu", results)
    runs = gpu_runs(results)
    plain = next(r for r in runs if r.precision == "float32" and r.step.startswith("PyTorch"))
    machine = data["machine"].split(";")[0]
    lines = [f"one rank on {machine} (recorded {data['recorded']}), medians of the steps:"]
    for r in runs:
        lines.append(
            f"  {r.step} ({r.precision}): {r.tokens_per_second:,.0f} tokens/s, "
            f"{r.tokens_per_second / plain.tokens_per_second:.2f}x PyTorch's float32 step, "
            f"MFU {r.mfu:g}%"
        )
    return lines


# ----------------------------------------------------------------------------- 2. memory


@dataclass(frozen=True)
class Held:
    """The bytes (MiB) the busiest rank held in the benchmark, measured: the model states of the
    rank with the most, and the activations' peak (the course's composition only)."""

    layout: str
    composition: str
    states: float  # the recorded sum (its parts are rounded apart)
    params: float
    grads: float
    optimizer: float
    activations: float | None


def held(results: Path = RESULTS) -> list[Held]:
    """The benchmark's rows, the planner's choice left out (it repeats a layout)."""
    data = load("lm_layouts", results)
    out = []
    for row in rows(data, f"layouts_w{_world(data)}"):
        if row["layout"].startswith(CHOICE):
            continue
        params, grads, optimizer = numbers(row["params / grads / optimizer MiB (max rank)"])
        peak = row["activations MiB (peak, max rank)"]
        library = row["layout"].startswith(LIBRARY)
        out.append(Held(
            row["layout"].removeprefix(LIBRARY), "library" if library else "course",
            number(row["held MiB per rank (max)"]), params, grads, optimizer,
            None if peak.strip() == "-" else number(peak),
        ))  # fmt: skip
    return out


@dataclass(frozen=True)
class PlannedMemory:
    """One layout of the planner's check: predicted (``lm.memory``: states from the shapes,
    activations from a measured rate) and measured MiB per rank."""

    world: int
    layout: str
    states_predicted: float
    states_measured: float
    activations_predicted: float
    activations_measured: float


def planned_memory(world: int, results: Path = RESULTS) -> list[PlannedMemory]:
    out = []
    for row in rows(load(f"lm_planner_w{world}", results), "check"):
        sp, sm = numbers(row["states MiB predicted / measured"])
        ap, am = numbers(row["activations MiB predicted / measured"])
        out.append(PlannedMemory(world, _layout(row["layout"]), sp, sm, ap, am))
    return out


def _layout(cell: str) -> str:
    return cell.removesuffix(" (anchor)")


def memory_lines(worlds: Sequence[int] = (4, 8), results: Path = RESULTS) -> list[str]:
    """Per world of the planner's check: how many layouts' states were predicted to the
    hundredth of a MiB printed, and the range of measured / predicted activations. From the
    benchmark: the least and most states held, and where the activations outweigh the states."""
    lines = []
    for world in worlds:
        mem = planned_memory(world, results)
        same = sum(m.states_predicted == m.states_measured for m in mem)
        ratios = [m.activations_measured / m.activations_predicted for m in mem]
        lines.append(
            f"world {world}: model states predicted = measured (to 0.01 MiB) in {same} of "
            f"{len(mem)} layouts; activations measured / predicted {min(ratios):.2f}-"
            f"{max(ratios):.2f}x"
        )
    bench = [h for h in held(results) if h.composition == "course"]
    least = min(h.states for h in bench)
    most = max(h.states for h in bench)
    heavier = [h for h in bench if h.activations is not None and h.activations > h.states]

    def named(mib: float) -> str:
        return "; ".join(h.layout for h in bench if h.states == mib)

    lines.append(
        f"benchmark, world {_world(load('lm_layouts', results))}: states per rank from "
        f"{least:.2f} MiB ({named(least)}) to {most:.2f} MiB ({named(most)}); the activations' "
        f"peak is above the states in {len(heavier)} of {len(bench)} layouts"
    )
    return lines


# ----------------------------------------------------------------------------- 3. the planner


@dataclass(frozen=True)
class Step:
    """One layout of the planner's check: its rank in the plan, predicted and measured ms."""

    world: int
    rank: int
    layout: str
    anchor: bool
    predicted_ms: float
    measured_ms: float
    ratio: float  # measured / predicted, as recorded (from the unrounded times)


def planner_steps(world: int, results: Path = RESULTS) -> list[Step]:
    out = []
    for row in rows(load(f"lm_planner_w{world}", results), "check"):
        out.append(Step(
            world, int(row["planner's rank"]), _layout(row["layout"]),
            row["layout"].endswith("(anchor)"), number(row["predicted ms"]),
            number(row["measured ms"]), number(row["measured / predicted"]),
        ))  # fmt: skip
    return out


def time_band(world: int, results: Path = RESULTS) -> tuple[float, float]:
    """The goal band of measured / predicted the check recorded (its note: ``goal A-Bx``)."""
    note = load(f"lm_planner_w{world}", results)["tables"]["check"]["note"]
    match = re.search(r"goal ([\d.]+)-([\d.]+)x", note)
    if match is None:
        raise ValueError(f"lm_planner_w{world}.json: no goal band in its note: {note!r}")
    return float(match[1]), float(match[2])


def planner_lines(worlds: Sequence[int] = (4, 8), results: Path = RESULTS) -> list[str]:
    """Per world: the range of measured / predicted, how many layouts fall inside the band, the
    rank correlation of the two orders, the first choice against the fastest measured."""
    lines = []
    for world in worlds:
        steps = planner_steps(world, results)
        low, high = time_band(world, results)
        inside = sum(low <= s.ratio <= high for s in steps)
        ratios = [s.ratio for s in steps]
        rho = spearman([s.predicted_ms for s in steps], [s.measured_ms for s in steps])
        first = min(steps, key=lambda s: s.rank)
        fastest = min(steps, key=lambda s: s.measured_ms)
        lines.append(
            f"world {world}: measured / predicted {min(ratios):.2f}-{max(ratios):.2f}x; inside "
            f"the {low:g}-{high:g}x band: {inside} of {len(steps)} layouts; rank correlation of "
            f"the predicted and measured orders {rho:.2f}"
        )
        verdict = (
            "it is the fastest measured"
            if first is fastest
            else f"the fastest measured is {fastest.layout} at {fastest.measured_ms:.1f} ms "
            f"({first.measured_ms / fastest.measured_ms:.2f}x)"
        )
        lines.append(
            f"world {world}: the planner's first choice {first.layout} measured "
            f"{first.measured_ms:.1f} ms; {verdict}"
        )
    return lines


# ----------------------------------------------------------------------------- 4. traffic


@dataclass(frozen=True)
class AxisBytes:
    """Rank 0's bytes in one step on one axis (MiB, counted by CommCounter), and the formulas'
    (``lm.traffic.expected_step``): the same number where the benchmark recorded 0 bytes off on
    every rank, unknown (None) where it recorded a difference or checked nothing."""

    layout: str
    axis: str
    measured: float
    formula: float | None


def traffic(results: Path = RESULTS) -> list[AxisBytes]:
    """Every course layout the formulas checked (the bytes-off column a number), by axis."""
    data = load("lm_layouts", results)
    out = []
    for row in rows(data, f"layouts_w{_world(data)}"):
        off = row["bytes off the formulas"].strip()
        if not off.isdigit() or row["layout"].startswith(CHOICE):
            continue
        for part in row["traffic per step of rank 0 (MiB by group)"].split(","):
            axis, mib = part.split()
            out.append(AxisBytes(row["layout"], axis, float(mib),
                                 float(mib) if int(off) == 0 else None))  # fmt: skip
    return out


def traffic_lines(results: Path = RESULTS) -> list[str]:
    """How many layouts' counts equal the formulas; the layouts the formulas do not check; the
    most bytes per step and its axis, against plain data parallelism."""
    data = load("lm_layouts", results)
    table = rows(data, f"layouts_w{_world(data)}")
    checked = [r for r in table if r["bytes off the formulas"].strip().isdigit()]
    exact = [r for r in checked if int(r["bytes off the formulas"]) == 0]
    unchecked = [
        r["layout"] for r in table
        if not r["bytes off the formulas"].strip().isdigit()
        and r["traffic per step of rank 0 (MiB by group)"].strip() != "-"
    ]  # fmt: skip
    lines = [
        f"CommCounter's count equals the formulas (0 bytes and 0 calls off, every rank, group "
        f"and op) in {len(exact)} of the {len(checked)} layouts checked; total bytes off "
        f"{data['values']['bytes_off']}"
    ]
    if unchecked:
        lines.append(
            f"not checked against these formulas: {', '.join(unchecked)} (its sends are counted; "
            "its own exercise's tests hold their bytes)"
        )
    axes = traffic(results)
    totals: dict[str, float] = {}
    for a in axes:
        totals[a.layout] = totals.get(a.layout, 0.0) + a.measured
    top = max(axes, key=lambda a: a.measured)
    if "data parallel" in totals:
        base = totals["data parallel"]
        most = max(totals, key=lambda name: totals[name])
        lines.append(
            f"the most bytes on one axis: {top.layout}, {top.axis} {top.measured:.2f} MiB per "
            f"step; the most in all: {most}, {totals[most] / base:.1f}x data parallel's "
            f"{base:.2f} MiB"
        )
    return lines


# ----------------------------------------------------------------------------- 5. 70B-class


@dataclass(frozen=True)
class Candidate:
    """A layout of the worked example: GB per GPU (states + activations), computed."""

    source: str  # "worked" (the example's own layouts) or "planner" (the planner's first ones)
    layout: str
    states_gb: float
    activations_gb: float
    step_s: float

    @property
    def total_gb(self) -> float:
        return self.states_gb + self.activations_gb


def device_gb(results: Path = RESULTS) -> float:
    """The GPU's memory the example plans for: its table's ``fits N GB`` column."""
    columns = load("lm_70b", results)["tables"]["layouts"]["columns"]
    title = next(c for c in columns if c.startswith("fits "))
    return number(title)


def candidates(results: Path = RESULTS) -> list[Candidate]:
    data = load("lm_70b", results)
    out = []
    for row in rows(data, "layouts"):
        states, activations = numbers(row["GB per GPU: states + activations"])
        step = number(row["step s: pipeline (compute, tp) + data-parallel"].split("+")[0])
        step += number(row["step s: pipeline (compute, tp) + data-parallel"].split("+")[-1])
        out.append(Candidate("worked", row["layout"], states, activations, step))
    for row in rows(data, "planned"):
        states, activations = numbers(row["GB per GPU: states + activations"])
        step = number(row["step s: pipeline + data-parallel + optimizer"])
        out.append(Candidate("planner", row["layout"], states, activations, step))
    return out


def example_lines(results: Path = RESULTS) -> list[str]:
    """What the example holds, which candidates fit the device, the heaviest, the planner's
    first choice and its share of the device."""
    data = load("lm_70b", results)
    gb = device_gb(results)
    cands = candidates(results)
    worked = [c for c in cands if c.source == "worked"]
    planned = [c for c in cands if c.source == "planner"]
    fit = [c for c in worked if c.total_gb <= gb]
    heaviest = max(cands, key=lambda c: c.total_gb)
    first = planned[0]
    values = data["values"]
    return [
        f"computed, not measured: {values['parameters']} parameters, {gb:g} GB per GPU",
        f"the example's own layouts: {len(fit)} of {len(worked)} fit {gb:g} GB; the ones that do "
        f"not: {'; '.join(c.layout for c in worked if c.total_gb > gb)}",
        f"the heaviest: {heaviest.layout}, {heaviest.total_gb:,.1f} GB per GPU "
        f"({heaviest.total_gb / gb:.1f}x the device)",
        f"the planner's first {len(planned)} of {values['planned_layouts']} layouts searched all "
        f"fit: {'yes' if all(c.total_gb <= gb for c in planned) else 'no'}; its first choice "
        f"{first.layout}: {first.total_gb:.1f} GB per GPU ({first.total_gb / gb:.0%} of the "
        f"device), step {first.step_s:g} s",
    ]
