"""What every rank holds and does in one step under a layout: the one description the planner's
memory and time models cost.

A layout (``ParallelSettings``) of the language model (``LMConfig``) at a global batch makes every
rank of one pipeline rank (all its dp, cp and tp ranks alike) hold and do the same things, and
:func:`describe` writes them down once, from the model's shapes and the layout alone (no rate,
no machine):

* **the schedule**: 2.5's actions of every pipeline rank (``make_schedule``) and the most
  (micro-batch, chunk) activations any rank holds at once (2.5's ``peak_in_flight``);
* **per pipeline rank** (:class:`RankWork`): its virtual stages, one per chunk, under the
  schedule's placement (the loop, or zb-v's V), each with its run of layers and how many times
  its backward walks the graph (twice for a zero-bubble stage after the first: B to the input,
  then W to the weights); the units it holds (a module owning parameters: each layer's, tp shards
  and E/ep experts, the embedding on the first virtual stage, the final norm and head on the
  last, one weight when tied on the same rank), the elements whose optimizer step it runs (all,
  or its 1/N slice under ZeRO, N = dp x cp), its pipeline actions; and **every collective it
  runs in a step** (:class:`Collective`: kind, group, what it carries, calls, and 3.2's ``Cost``
  of one call: ring rounds and bytes sent), as ``lm.traffic``'s formulas count the composition's
  calls (its module doc);
* **per micro-batch** (for the schedule played on paper): the tokens one rank computes, one
  tensor-parallel region's all-reduce, one ring-attention pass, one stage boundary's message.

Who costs it: ``lm.memory`` in bytes (the states from the units and 3.5's padding, the
activations from a measured rate per token and the peak in flight); ``lm.planner`` in seconds on
the critical path (the micro-batch's pieces in 2.5's ``simulate``, the busiest rank's gradient
collectives); ``lm.shared_cores`` in CPU seconds when ranks share cores (each rank's stages,
actions and collectives), calibrated by ``lm.calibration`` on the anchor steps' own descriptions;
``lm.planner_check`` and the worked example read it beside the predictions. One description, so
that the models cannot disagree on what a rank holds or sends, and none recomputes it on a path
of its own.

The counts follow the composition of exercise 4.7 (``lm.traffic``): tp, per layer and
micro-batch, two regions each way (an all-reduce each, or an all-gather and a reduce-scatter under
sequence parallelism; a zero-bubble W runs the backward's again), and with sequence parallelism
the report and the norms' gradients; cp, per layer and micro-batch, a pass of K and V per ring
step forward and two backward (K and V again, then dK and dV); pp, the activations forward and
their gradients back at each boundary between two ranks, a header, and the report; dp x cp the
count and the report, then the gradients: one all-reduce (plain data parallelism), or per unit
ZeRO-1's reduce-scatter and all-gather, ZeRO-2's reduce-scatter per micro-batch and all-gather,
ZeRO-3's (and FSDP-style) reduce-scatter and two all-gathers per micro-batch (Rajbhandari et
al., 2020). Groups of one rank call nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from course.language_model import LMConfig
from phase2_advanced.pipeline_actions import Action
from phase2_advanced.pipeline_layout import virtual_stage
from phase4_production.lm_blocks import split_layers
from phase4_production.lm_layout import ZERO_BUBBLE, ParallelSettings
from solutions.phase2_advanced.pipeline_schedules import (
    make_schedule,
    peak_in_flight,
    placement_of,
)
from solutions.phase3_multi_node.alpha_beta import Cost, ring_cost

KINDS = ("tp", "cp", "pp", "dp", "zero")  # the collectives' kinds, in the order they are priced
GROUPS = {"tp": "tp", "cp": "cp", "pp": "pp", "dp": "dp_cp", "zero": "dp_cp"}  # RankGrid names
SMALL = 16  # bytes of a small all-reduce (the count, a report), as the CPU model prices them
HEADER = 64  # bytes of a stage boundary's header
GRADIENTS = "gradients"  # what the data-parallel gradients' collectives carry


@dataclass(frozen=True)
class Collective:
    """Calls of one collective (or point-to-point message) a rank makes in a step: its kind
    (:data:`KINDS`), the ``RankGrid`` group it runs on and how many ranks that group has, what
    it carries, how many calls, and 3.2's ``Cost`` of one call (ring rounds, bytes sent)."""

    kind: str
    group: str
    ranks: int
    what: str
    calls: int
    cost: Cost


@dataclass(frozen=True)
class Stage:
    """One virtual stage a rank holds: its index, its run of layers, and how many times its
    backward walks the graph (2: a zero-bubble B to the input, then W to the weights)."""

    index: int
    layers: range
    passes: int


@dataclass(frozen=True)
class RankWork:
    """What every rank of one pipeline rank holds and does in a step (see the module doc)."""

    pp_rank: int
    stages: tuple[Stage, ...]
    units: tuple[int, ...]  # elements of each unit held (before ZeRO's sharding)
    owned: int  # elements whose optimizer step this rank runs
    actions: int  # pipeline actions a step: F and B per micro-batch and chunk, and W
    messaging: int  # of which F and B (each sends a message and waits for one)
    collectives: tuple[Collective, ...]
    kinds: Mapping[str, tuple[Cost, int]]  # each kind's total (rounds and bytes, calls)

    @property
    def calls(self) -> int:
        """Every collective call and message of the step."""
        return sum(calls for _, calls in self.kinds.values())

    @property
    def gradients(self) -> tuple[Collective, ...]:
        """The data-parallel gradients' collectives: one all-reduce, or ZeRO's per unit."""
        return tuple(c for c in self.collectives if c.what == GRADIENTS)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on one rank, what the schedule is played with: its tokens, those held
    between the tensor-parallel regions (a tp share under sequence parallelism), its bytes in a
    layer, and one call of each collective a layer or a stage makes of it."""

    tokens: int
    between: int
    activation: int
    region: Cost  # one tensor-parallel region's all-reduce
    ring_pass: Cost  # one ring-attention pass: a K and a V block of this rank's heads
    message: Cost  # one stage boundary's activations (or their gradients)


@dataclass(frozen=True)
class LayoutWork:
    """One layout's step, described once: the schedule, one micro-batch's pieces, and every
    pipeline rank's :class:`RankWork`."""

    config: LMConfig
    settings: ParallelSettings
    batch: int  # global, sequences
    element: int  # bytes per element computed and sent
    schedule: tuple[tuple[Action, ...], ...]  # every pipeline rank's actions (2.5)
    in_flight: int  # the most (micro-batch, chunk) activations a rank holds at once
    layers_per_chunk: int  # the busiest chunk's layers
    micro: MicroBatch
    small_all_reduces: int  # the count, the reports, and with clipping the norm on each axis
    ranks: tuple[RankWork, ...]  # one per pipeline rank

    @property
    def shards(self) -> int:
        """The ranks ZeRO shards over and the gradients are summed over (dp x cp)."""
        return self.settings.dp * self.settings.cp

    @property
    def busiest(self) -> RankWork:
        """The pipeline rank that holds the most parameter elements (the first of equals)."""
        return max(self.ranks, key=lambda rank: sum(rank.units))


def layer_units(config: LMConfig, layer: int, tp: int, ep: int) -> list[int]:
    """Elements of each unit one layer holds on a rank (tp shards, E/ep experts), as the
    runtime's wrap policy groups them: one unit per block (an MoE block, which ZeRO refuses,
    listed by kind: the norms and the router, the attention, the experts)."""
    h = config.width
    attention = 3 * h * h // tp + h * h // tp  # qkv, out
    if config.is_moe(layer):
        per_expert = 2 * h * config.expert_ffn + config.expert_ffn + h  # two Linears, biased
        whole = 2 * h + config.num_experts * h  # the norms and the router
        return [whole, attention, per_expert * (config.num_experts // ep)]
    return [2 * h + attention + 2 * config.ffn * h // tp + h * config.ffn // tp]  # + SwiGLU


def gather_cost(full_bytes: float, n: int) -> Cost:
    """An all-gather or a reduce-scatter of ``full_bytes`` over n ranks on a ring: n - 1 steps,
    (n - 1)/n of the bytes through each link (half of a ring all-reduce)."""
    return Cost(n - 1, (n - 1) / n * full_bytes) if n > 1 else Cost(0, 0)


def describe(config: LMConfig, settings: ParallelSettings, batch: int, element: int) -> LayoutWork:
    """The step of ``settings`` for this model at a global ``batch`` of sequences, ``element``
    bytes per element computed and sent (see the module doc)."""
    s, h, e = settings, config.width, element
    m, tp = s.microbatches, s.tp
    tokens = batch // (s.dp * m) * config.seq_len // s.cp
    between = tokens // tp if s.sequence_parallel else tokens
    activation = tokens * h * e
    micro = MicroBatch(
        tokens, between, activation, ring_cost(activation, tp), Cost(2, 2 * activation // tp),
        Cost(1, between * h * e),
    )  # fmt: skip
    schedule = make_schedule(s.schedule, s.pp, m, s.chunks)
    runs = split_layers(config.layers, s.virtual_stages)
    return LayoutWork(
        config=config,
        settings=s,
        batch=batch,
        element=e,
        schedule=tuple(tuple(actions) for actions in schedule),
        in_flight=max(peak_in_flight(actions) for actions in schedule),
        layers_per_chunk=math.ceil(config.layers / s.virtual_stages),
        micro=micro,
        small_all_reduces=3 + (4 if s.max_norm is not None else 0),
        ranks=tuple(_rank_work(config, s, runs, r, e, micro) for r in range(s.pp)),
    )


def _units(config: LMConfig, settings: ParallelSettings, stages: tuple[Stage, ...]) -> list[int]:
    """Elements of every unit a rank holds: its stages' layers, the embedding where it holds the
    first virtual stage, the final norm and the head where it holds the last (one weight when
    tied on the same rank)."""
    indices = [stage.index for stage in stages]
    last = settings.virtual_stages - 1
    units = [unit for stage in stages for layer in stage.layers
             for unit in layer_units(config, layer, settings.tp, settings.ep)]  # fmt: skip
    if 0 in indices:
        units.append(config.vocab * config.width)  # the embedding
    if last in indices:
        units.append(config.width)  # the final norm
        if not (config.tied and 0 in indices):
            units.append(config.vocab * config.width)  # the head
    return units


def _rank_work(
    config: LMConfig,
    settings: ParallelSettings,
    runs: list[range],
    pp_rank: int,
    e: int,
    micro: MicroBatch,
) -> RankWork:
    """One pipeline rank's :class:`RankWork`, ``runs`` the layers of each virtual stage."""
    s, m = settings, settings.microbatches
    last = s.virtual_stages - 1
    zero_bubble = s.schedule in ZERO_BUBBLE
    placement = placement_of(s.schedule)
    indices = [virtual_stage(pp_rank, chunk, s.pp, placement) for chunk in range(s.chunks_per_rank)]
    stages = tuple(
        Stage(index, runs[index], 2 if zero_bubble and index > 0 else 1) for index in indices
    )
    units = _units(config, s, stages)
    shards = s.dp * s.cp
    collectives: list[Collective] = []

    def add(kind: str, what: str, cost: Cost, calls: int, ranks: int) -> None:
        if ranks > 1 and calls > 0:
            collectives.append(Collective(kind, GROUPS[kind], ranks, what, calls, cost))

    for stage in stages:
        regions = 2 * len(stage.layers) * m * (1 + stage.passes)
        if s.sequence_parallel:  # an all-gather and a reduce-scatter per region
            add("tp", "regions", gather_cost(micro.activation, s.tp), 2 * regions, s.tp)
        else:
            add("tp", "regions", micro.region, regions, s.tp)
        ring_passes = len(stage.layers) * m * (1 + 2 * stage.passes) * (s.cp - 1)
        add("cp", "ring passes", micro.ring_pass, ring_passes, s.cp)
        for neighbour in (stage.index + 1, stage.index - 1):
            if 0 <= neighbour <= last and neighbour not in indices:  # activations and gradients
                add("pp", "activations", micro.message, 2 * m, s.pp)
                add("pp", "header", Cost(1, HEADER), 1, s.pp)
    add("dp", "count and report", ring_cost(SMALL, shards), 2, shards)
    if s.zero == 0:
        add("dp", GRADIENTS, ring_cost(sum(units) * e, shards), 1, shards)
    else:
        per_unit = {1: 2, 2: m + 1}.get(s.zero, 3 * m) if isinstance(s.zero, int) else 3 * m
        for unit in units:
            add("zero", GRADIENTS, gather_cost(unit * e, shards), per_unit, shards)
    add("pp", "report", ring_cost(SMALL, s.pp), 1, s.pp)
    if s.sequence_parallel:
        add("tp", "report and norms", ring_cost(SMALL * config.width, s.tp), 2, s.tp)
    kinds = {kind: (Cost(0, 0), 0) for kind in KINDS}
    for c in collectives:  # each kind's total, in the order the calls were listed
        total, calls = kinds[c.kind]
        kinds[c.kind] = (total + Cost(c.cost.rounds * c.calls, c.cost.bytes_sent * c.calls),
                         calls + c.calls)  # fmt: skip
    return RankWork(
        pp_rank=pp_rank,
        stages=stages,
        units=tuple(units),
        owned=sum(units) if s.zero == 0 else math.ceil(sum(units) / shards),
        actions=len(stages) * m * (3 if zero_bubble else 2),
        messaging=len(stages) * m * 2,
        collectives=tuple(collectives),
        kinds=kinds,
    )
