"""Anchor steps: the language model's own step, timed in the world the rates are measured in,
for one layout per kind of collective, so that the planner's shared-core model is tied to what
this machine does with this model rather than to its parts alone.

The planner prices ranks that share cores by every rank's CPU over the cores
(``lm.calibration.rank_cpu``), a sum of parts: the layers' compute, the pipeline's actions, and the
collectives of each kind (tensor-parallel regions, ring-attention passes, pipeline messages,
data-parallel gradients). Each part comes from rates measured apart (a layer alone, collectives
after a layer's work, a tiny model's framework overhead); on a machine whose ranks share two
cores those move from run to run (the planner check records them), and one kind's framework
code is not another's (3.6's region functions, 2.7's block merges). Eleven steps of the model
itself, each adding one kind to plain data parallelism, measure what those parts sum to:

* ``dp``: data parallelism over the world; ``zero``: the same with ZeRO-2 (the gradients'
  reduce-scatters and all-gathers per unit);
* ``tp``: dp ``world / 2`` x tp2; ``tp4``: dp ``world / 4`` x tp4 (as many region calls, three
  times the ring rounds); ``tp_micro``: ``tp`` with sequence parallelism and 4 micro-batches (8
  times the calls, the same bytes);
* ``cp``: dp ``world / 2`` x cp2; ``cp4``: dp ``world / 4`` x cp4 (the same bytes per ring pass
  as cp2, attention blocks half as large); ``cp_micro``: ``cp`` with 4 micro-batches (4 times
  the passes, the same bytes and block elements);
* ``pp``: dp ``world / 2`` x pp2 under 1F1B at 2 micro-batches (the pipeline's own CPU: its
  actions, messages and waits); ``pp_micro``: the same at 4 micro-batches (twice the actions
  and messages, the same step); ``pp4``: dp ``world / 4`` x pp4 at 8 micro-batches (a quarter
  of the layers per stage, twice ``pp_micro``'s actions: three pipelines fit step and action by
  least squares over 4 to 16 actions a rank, and deep pipelines have an anchor of their own),

at the batch to be planned (where the layout takes it; else two sequences per data-parallel
rank), played in turn round after round (a load that comes and goes lands on all of them alike).
For each: every rank's CPU seconds per step, summed (for ``dp`` the median over rounds; for the
others dp's median times the median of each round's ratio to its own dp step), and how much longer
the slowest rank's step took than that sum over the cores (the cores left idle while ranks wait
to be woken). ``lm.calibration.calibration`` turns them into a common scale and each kind's extra
CPU; this module only measures. The idea is the calibration step of analytical performance
models (Hockney's and LogP's parameters are measured, not derived): the planner
keeps its counts and its shape, the machine supplies the constants.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course.impl import load_impl
from course.language_model import LMConfig, build_language_model
from course.topology import GroupPool, Topology
from phase4_production.lm_layout import ParallelSettings


@dataclass(frozen=True)
class Anchor:
    """One anchor step, measured: its layout, the model and global batch it ran, every rank's
    CPU seconds per step summed, and its step over that CPU divided by the cores."""

    kind: str
    settings: ParallelSettings
    model: LMConfig
    sequences: int
    cpu: float
    idle: float


def anchor_layouts(
    config: LMConfig, world: int, batch: int | None = None
) -> dict[str, tuple[ParallelSettings, int]]:
    """Every anchor layout this model and world allow, by kind, with its global batch: the
    batch the planner plans for where the layout takes it (a step's fixed and per-token costs
    then weigh as they will in the plan), else two sequences per data-parallel rank."""
    half = world // 2
    options = {
        "dp": {"dp": world},
        "zero": {"dp": world, "zero": 2},
        "tp": {"dp": half, "tp": 2},
        "tp4": {"dp": world // 4, "tp": 4},
        "tp_micro": {"dp": half, "tp": 2, "sequence_parallel": True, "microbatches": 4},
        "cp": {"dp": half, "cp": 2},
        "cp4": {"dp": world // 4, "cp": 4},
        "cp_micro": {"dp": half, "cp": 2, "microbatches": 4},
        "pp": {"dp": half, "pp": 2, "microbatches": 2},
        "pp_micro": {"dp": half, "pp": 2, "microbatches": 4},
        "pp4": {"dp": world // 4, "pp": 4, "microbatches": 8},
    }
    out = {}
    for kind, chosen in options.items():
        settings = ParallelSettings(lr=1e-3, **chosen)  # type: ignore[arg-type]
        sequences = 2 * settings.dp * settings.microbatches
        if batch is not None and not settings.problems(config, batch):
            sequences = batch
        if world >= 2 and settings.world_size == world and not settings.problems(config, sequences):
            out[kind] = (settings, sequences)
    return out


def measure_anchors(config: LMConfig, repeats: int, batch: int | None = None) -> list[Anchor]:
    """On every rank of the running world (every rank returns the same list): each anchor
    layout's step (:func:`anchor_layouts`), warmed up once, then ``repeats`` rounds of all of
    them in turn."""
    lm = load_impl("phase4_production", "lm_parallel", "solutions")
    world, cores = dist.get_world_size(), len(os.sched_getaffinity(0))
    layouts = anchor_layouts(config, world, batch)
    generator = torch.Generator().manual_seed(0)
    pool = GroupPool()  # one group per rank set for all the anchors, freed after them
    steps = {}
    for kind, (settings, sequences) in layouts.items():
        data = torch.randint(0, config.vocab, (sequences, config.seq_len + 1), generator=generator)
        tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        topology = Topology.build(settings.dp, settings.tp, settings.pp, cp=settings.cp,
                                  pool=pool)  # fmt: skip
        model = lm.ParallelLanguageModel(build_language_model(config, 0, torch.float32),
                                         topology, settings)  # fmt: skip
        model.train_step(tokens, targets)  # warm-up
        steps[kind] = (model, tokens, targets)
    cpu: dict[str, list[float]] = {kind: [] for kind in steps}
    idle: dict[str, list[float]] = {kind: [] for kind in steps}
    for _ in range(repeats):
        for kind, (model, tokens, targets) in steps.items():
            dist.barrier()
            began_cpu, began = time.process_time(), time.perf_counter()
            model.train_step(tokens, targets)
            both = torch.tensor([time.process_time() - began_cpu, time.perf_counter() - began],
                                dtype=torch.float64)  # fmt: skip
            summed, slowest = both.clone(), both.clone()
            dist.all_reduce(summed)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            cpu[kind].append(float(summed[0]))
            idle[kind].append(float(slowest[1]) / (float(summed[0]) / min(cores, world)))
    steps.clear()
    pool.destroy()
    out = []
    base = statistics.median(cpu["dp"]) if "dp" in cpu else 0.0
    for kind in cpu:
        settings, sequences = layouts[kind]
        median_cpu = statistics.median(cpu[kind])
        if kind != "dp" and base > 0:  # each round's ratio to its own dp step, times dp's median
            median_cpu = base * statistics.median(
                c / d for c, d in zip(cpu[kind], cpu["dp"], strict=True)
            )
        out.append(Anchor(kind, settings, config, sequences, median_cpu,
                          statistics.median(idle[kind])))  # fmt: skip
    return out
