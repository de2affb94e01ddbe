"""Benchmark of exercise 4.7: tokens/s, held bytes and each axis's traffic, layout by layout.

One world (4 ranks by default) builds the language model of 4.7 once per layout (the same
weights, float32), then plays their steps interleaved, round after round, so that every layout
meets the same machine (a load that comes and goes lands on all of them alike); the median of a
layout's step times (the slowest rank's) gives its tokens/s. After the rounds, every rank's held
bytes are read (parameters, gradients and optimizer state: distinct storages, as 3.5 counts
them), and one more step is counted by ``CommCounter`` and compared, group by group and op by op,
with ``lm.traffic.expected_step``'s formulas: the "bytes off" column must read 0 (the MoE rows,
whose split depends on the routing, are checked per ep group). The library composition
(``lm/library.py``: DeviceMesh, ``parallelize_module``, ``fully_shard``, pipelining) runs the
layouts it supports in the same rounds (FSDP2 shards every weight whatever the ZeRO stage, and
its held bytes count DTensors' local shards)::

    uv run python -m solutions.phase4_production.lm.benchmark            # print
    uv run python -m solutions.phase4_production.lm.benchmark --record   # and record
    uv run python -m solutions.phase4_production.lm.benchmark --world 8 --rounds 3

``--impl templates`` measures your own 4.7 (and your 2.5-3.8 under it).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course.cli import benchmark_main, run_main
from course.impl import IMPLS, load_impl
from course.language_model import LMConfig, build_language_model
from course.results import Table, write_results
from course.topology import GroupPool, Topology
from course.verdicts import Goal, Load, LoadMeter, pair_ratios
from course.world import run_world
from phase4_production.lm_layout import ParallelSettings
from solutions.phase3_multi_node.benchmarks.strategies import ActivationMeter
from solutions.phase3_multi_node.references.zero_accounting import held_bytes
from solutions.phase4_production.lm import traffic as lm_traffic
from solutions.phase4_production.lm.framework_run import rates_in_world
from solutions.phase4_production.lm.planner import GIB, Machine, plan
from solutions.phase4_production.lm.rates import process_cpu

RESULTS = Path(__file__).resolve().parents[3] / "phase4_production" / "results" / "lm_layouts.json"
PHASE = "phase4_production"
# name -> (settings, MoE model?); every layout fills a world of 4 (8: see layouts_for)
LAYOUTS_4: dict[str, tuple[dict[str, Any], bool]] = {
    "data parallel": ({"dp": 4}, False),
    "data parallel, 3.1's ring": ({"dp": 4, "communication": "ring"}, False),
    "pipeline (1F1B)": ({"pp": 4, "microbatches": 4}, False),
    "ZeRO-2": ({"dp": 4, "zero": 2}, False),
    "FSDP-style": ({"dp": 4, "zero": "fsdp"}, False),
    "tensor + sequence": ({"tp": 4, "sequence_parallel": True}, False),
    "context (ring)": ({"cp": 4}, False),
    "experts": ({"dp": 4, "ep": 4}, True),
    "dp2 x tp2+sp": ({"dp": 2, "tp": 2, "sequence_parallel": True}, False),
    "cp2 x pp2": ({"cp": 2, "pp": 2, "microbatches": 2}, False),
}


@dataclass
class BenchConfig:
    """Flags of the benchmark."""

    world: int = field(default=4, metadata={"choices": (4, 8), "help": "ranks of the world"})
    rounds: int = field(default=5, metadata={"ge": 1, "le": 1000, "fix": "e.g. 5"})
    warmup: int = field(default=2, metadata={"ge": 0, "le": 100, "fix": "e.g. 2"})
    batch: int = field(default=16, metadata={"ge": 4, "le": 4096, "fix": "a multiple of 8"})
    seq_len: int = field(default=128, metadata={"ge": 16, "le": 8192, "fix": "e.g. 128"})
    width: int = field(default=64, metadata={"ge": 8, "le": 8192, "fix": "e.g. 64"})
    layers: int = field(default=4, metadata={"ge": 4, "le": 256, "fix": "e.g. 4"})
    library: bool = field(default=True, metadata={"help": "also the library composition"})
    planner: bool = field(default=True, metadata={"help": "also the planner's choice"})
    impl: str = field(default="solutions", metadata={"choices": IMPLS})
    record: bool = field(default=False, metadata={"help": f"write {RESULTS.name}"})

    def model(self, moe: bool) -> LMConfig:
        return LMConfig(
            width=self.width, heads=4, layers=self.layers, ffn=2 * self.width,
            seq_len=self.seq_len, moe_layers=(1, 3) if moe else (), expert_ffn=self.width,
        )  # fmt: skip


def layouts_for(world: int) -> dict[str, tuple[dict[str, Any], bool]]:
    if world == 4:
        return LAYOUTS_4
    return {  # 8 ranks: the same kinds, doubled on data parallelism or composed
        "data parallel": ({"dp": 8}, False),
        "dp2 x tp2 x pp2": ({"dp": 2, "tp": 2, "pp": 2, "microbatches": 2}, False),
        "dp2 x cp2 x tp2+sp": ({"dp": 2, "cp": 2, "tp": 2, "sequence_parallel": True}, False),
        "ZeRO-3 x tp2 x pp2": ({"dp": 2, "tp": 2, "pp": 2, "microbatches": 2, "zero": 3}, False),
        "pp2 x cp2 x ep2 (MoE)": ({"dp": 2, "cp": 2, "pp": 2, "ep": 4, "microbatches": 2}, True),
    }


def settings_of(options: dict[str, Any]) -> ParallelSettings:
    return ParallelSettings(lr=1e-3, **options)


def validate(config: BenchConfig) -> None:
    problems = []
    for name, (options, moe) in layouts_for(config.world).items():
        for problem in settings_of(options).problems(config.model(moe), config.batch):
            problems.append(f"{name}: {problem}")
    if problems:
        raise ValueError("; ".join(problems))


def batch(step: int, config: BenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, 256, (config.batch, config.seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


@dataclass
class Entry:
    name: str
    model: Any
    library: bool = False
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # this rank's process CPU seconds per step


def _library_entries(config: BenchConfig) -> list[Entry]:
    if not config.library:
        return []
    try:
        library = load_impl(PHASE, "lm.library", "solutions")
    except ImportError:
        return []
    entries = []
    for name, (options, moe) in layouts_for(config.world).items():
        settings = settings_of(options)
        if library.unsupported(settings, config.model(moe)) is not None:
            continue
        topology = Topology.build(settings.dp, settings.tp, settings.pp, cp=settings.cp,
                                  ep=settings.ep)  # fmt: skip
        dense = build_language_model(config.model(moe), 0, torch.float32)
        entries.append(Entry(name, library.LibraryLanguageModel(dense, topology, settings), True))
    return entries


def planner_choice(config: BenchConfig) -> tuple[str, tuple[dict[str, Any], bool]]:
    """The layout ``sharding: auto`` would run here: rates measured in this world, the
    planner's first choice for the dense model (lm/planner.py, lm/framework.py)."""
    model = config.model(False)
    rates = rates_in_world(model, torch.float32, batch=config.batch)
    machine = Machine(config.world, config.world, 16 * GIB, 4)
    choice = plan(model, rates, machine, config.batch, max_norm=None, lr=1e-3)[0].settings
    options = {f.name: getattr(choice, f.name) for f in fields(choice)
               if f.name not in ("lr", "betas", "weight_decay", "max_norm")}  # fmt: skip
    return f"planner's choice: {choice.label()}", (options, False)


def measure_rank(config: BenchConfig) -> dict[str, Any]:
    """Every layout of the world on this rank, and the planner's choice (see
    :func:`measure_layouts`)."""
    layouts = dict(layouts_for(config.world))
    if config.planner:
        name, layout = planner_choice(config)
        layouts[name] = layout
    return measure_layouts(config, layouts, library=config.library)


def measure_layouts(
    config: BenchConfig, layouts: dict[str, tuple[dict[str, Any], bool]], library: bool
) -> dict[str, Any]:
    """``layouts`` on this rank: built, warmed up, timed in interleaved rounds, weighed (model
    states, and the activations autograd saved during one more step) and counted; returns this
    rank's rows, by layout name."""
    _quiet_library_warnings()
    lm = load_impl(PHASE, "lm_parallel", config.impl)
    entries = []
    pool = GroupPool()  # one group per rank set for all the layouts, freed after them
    for name, (options, moe) in layouts.items():
        settings = settings_of(options)
        topology = Topology.build(settings.dp, settings.tp, settings.pp, cp=settings.cp,
                                  ep=settings.ep, pool=pool)  # fmt: skip
        dense = build_language_model(config.model(moe), 0, torch.float32)
        entries.append(Entry(name, lm.ParallelLanguageModel(dense, topology, settings)))
    entries += _library_entries(config) if library else []
    for step in range(config.warmup + config.rounds):
        tokens, targets = batch(step, config)
        for entry in entries:
            dist.barrier()
            cpu, started = process_cpu(), time.perf_counter()
            entry.model.train_step(tokens, targets)
            cpu = process_cpu() - cpu
            seconds = slowest(time.perf_counter() - started)
            if step >= config.warmup:
                entry.times.append(seconds)
                entry.cpu.append(cpu)
    rows = {}
    tokens, targets = batch(config.warmup + config.rounds, config)
    for entry in entries:
        row: dict[str, Any] = {"seconds": statistics.median(entry.times), "times": entry.times,
                               "spread": (min(entry.times), max(entry.times)),
                               "cpu": statistics.median(entry.cpu)}  # fmt: skip
        if not entry.library:
            hand_made = entry.model.settings.communication != "library"
            with ActivationMeter(entry.model.model) as meter:
                got = lm_traffic.measure_step(entry.model, tokens, targets)
            held = held_bytes(entry.model.model, entry.model.optimizer)
            row["held"] = (held.params, held.grads, held.optimizer)
            row["activations"] = meter.peak_bytes
            row["traffic"] = {f"{k[0]} {k[1]}": t.nbytes for k, t in got.items()}
            if hand_made:  # the ring's sends: 3.1's own tests hold their bytes, not these formulas
                rows[entry.name] = row
                continue
            want = lm_traffic.expected_step(entry.model, config.batch)
            row["off"] = sum(abs(g.nbytes - w.nbytes) + abs(g.calls - w.calls)
                             for _, g, w in lm_traffic.differences(got, want))  # fmt: skip
            row["moe_rows"] = sum(t.nbytes for k, t in got.items() if k[1] == lm_traffic.ROWS)
            row["moe_rows_expected"] = lm_traffic.moe_rows_expected(entry.model, config.batch)
            row["ep"] = entry.model.topology.group_ranks("ep")
        else:  # the library's parameters are DTensors: their local shards are what is held
            held = held_bytes(nn.ModuleList(entry.model.stages), entry.model.optimizer)
            row["held"] = (held.params, held.grads, held.optimizer)
        rows[("library " if entry.library else "") + entry.name] = row
    entries.clear()
    pool.destroy()
    return rows


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def report(result: tuple[list[dict[str, Any]], Load], config: BenchConfig) -> str:
    per_rank, load = result
    tokens = config.batch * config.seq_len
    columns = ["layout", "tokens/s", "step ms (min-max)", "held MiB per rank (max)",
               "params / grads / optimizer MiB (max rank)", "activations MiB (peak, max rank)",
               "bytes off the formulas", "traffic per step of rank 0 (MiB by group)"]  # fmt: skip
    table = Table(columns)
    for name, row in per_rank[0].items():
        seconds = row["seconds"]
        low, high = row["spread"]
        held = [r[name]["held"] for r in per_rank if r[name]["held"] is not None]
        if held:
            worst = max(held, key=sum)
            held_text, parts = _mib(sum(worst)), " / ".join(_mib(x) for x in worst)
        else:
            held_text = parts = "-"
        if "traffic" in row and "off" not in row:  # a hand-made all-reduce's p2p sends
            off_text = "- (3.1's tests)"
            sent: dict[str, int] = {}
            for key, nbytes in row["traffic"].items():
                label, op = key.split(" ")[0].split("+")[0], key.split(" ")[1]
                if op != "irecv":  # what rank 0 sent, as for the collectives' rows
                    sent[label] = sent.get(label, 0) + nbytes
            traffic = ", ".join(f"{g} {_mib(b)} (sent)" for g, b in sorted(sent.items()))
        elif "off" in row:
            off = sum(r[name]["off"] for r in per_rank)
            if row["moe_rows_expected"]:  # the rows' split follows the routing: per ep group
                groups: dict[tuple[int, ...], int] = {}
                for r in per_rank:
                    key = tuple(r[name]["ep"])
                    groups[key] = groups.get(key, 0) + r[name]["moe_rows"]
                off += sum(abs(total - row["moe_rows_expected"]) for total in groups.values())
            by_group: dict[str, int] = {}
            for key, nbytes in row["traffic"].items():
                label = key.split(" ")[0].split("+")[0]
                by_group[label] = by_group.get(label, 0) + nbytes
            traffic = ", ".join(f"{g} {_mib(b)}" for g, b in sorted(by_group.items()))
            off_text = str(off)
        else:
            off_text, traffic = "-", "-"
        peaks = [r[name].get("activations") for r in per_rank]
        activations = _mib(max(peaks)) if all(p is not None for p in peaks) else "-"
        table.add(name, f"{tokens / seconds:,.0f}", f"{seconds * 1e3:.1f} ({low * 1e3:.1f}-"
                  f"{high * 1e3:.1f})", held_text, parts, activations, off_text,
                  traffic or "-")  # fmt: skip
    total_off = sum(int(cells[6]) for cells in table.rows if cells[6].isdigit())
    values = {"bytes_off": str(total_off), "world": str(config.world),
              "rounds": str(config.rounds)}  # fmt: skip
    for name, row in per_rank[0].items():  # the planner's choice beside plain data parallel
        if name.startswith("planner's choice: ") and "data parallel" in per_rank[0]:
            values["planner_choice"] = name.removeprefix("planner's choice: ")
            speed = per_rank[0]["data parallel"]["seconds"] / row["seconds"]
            values["planner_choice_vs_data_parallel"] = f"{speed:.2f}x"
    versus, verdicts = library_table(per_rank[0], load, tokens)
    values.update(verdicts)
    tables = {f"layouts_w{config.world}": table}
    if versus.rows:
        tables[f"vs_library_w{config.world}"] = versus
    if config.record:
        write_results(RESULTS, tables=tables, values=values)
    more = f"\n\n{versus.to_markdown()}\n\n{versus.note}" if versus.rows else ""
    return (
        f"world {config.world}, {config.rounds} interleaved rounds after {config.warmup} "
        f"warm-up; global batch {config.batch} x {config.seq_len} tokens, width "
        f"{config.width}, {config.layers} layers, float32\n\n{table.to_markdown()}\n\n"
        f"bytes off the formulas, all layouts and ranks: {total_off}{more}"
    )


def measure(config: BenchConfig) -> tuple[list[dict[str, Any]], Load]:
    meter = LoadMeter()
    with meter.running(processes=config.world):
        per_rank = run_world(measure_rank, config.world, (config,), {}, timeout=3600)
    return per_rank, meter.read()


LIBRARY_GOAL = Goal("tokens/s of the course's composition / the library's, round by round", 1.0)


def library_table(rows: dict[str, Any], load: Load, tokens: int) -> tuple[Table, dict[str, str]]:
    """Each layout the library runs too: the ratio of tokens/s round by round (the two played
    in the same rounds), and course.verdicts' three-way verdict against 1.0x."""
    table = Table(["layout", "course tokens/s", "library tokens/s", "course / library (middle "
                   "half of the rounds)", "verdict (goal >= 1.0x)"])  # fmt: skip
    values: dict[str, str] = {}
    for name, row in rows.items():
        library = rows.get(f"library {name}")
        if name.startswith("library ") or library is None:
            continue
        ratios = pair_ratios(library["times"], row["times"])  # its time / ours = our speed-up
        verdict = LIBRARY_GOAL.judge(ratios, load, cell=name, per="round")
        table.add(name, f"{tokens / row['seconds']:,.0f}", f"{tokens / library['seconds']:,.0f}",
                  f"{statistics.median(ratios):.2f}x ({verdict.spread.text('x')})",
                  verdict.short)  # fmt: skip
        key = name.replace(" ", "_").replace("(", "").replace(")", "").replace("-", "_").lower()
        values[f"vs_library_{key}"] = f"{statistics.median(ratios):.2f}x"
        values[f"vs_library_{key}_verdict"] = verdict.short
    table.note = f"tokens/s: the medians of the rounds; {load.text()}"
    return table, values


def _quiet_library_warnings() -> None:
    """torch's advice that does not apply here: no output of a fully_shard module is changed
    in place (the views it warns of), as lm_library_compare says too."""
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(BenchConfig, argv, __doc__, validate=validate, measure=measure,
                          report=report)  # fmt: skip


if __name__ == "__main__":
    run_main(main)
