"""The layout planner: every legal layout of a world, its bytes per rank and its step time,
predicted from the course's own cost models and this machine's measured rates.

Given the model, the global batch, the world (ranks, ranks per node, memory per rank) and the
rates ``lm.rates`` measured, :func:`plan` enumerates the layouts the settings accept (degrees of
dp, cp, tp, pp that fill the world, with sequence parallelism or not, ZeRO stages, pipeline
schedules and micro-batches), predicts for each

* **the bytes held per rank** (``lm.memory``): parameters, gradients and optimizer state from the
  exact shapes and 3.5's padding; activations from the measured bytes per token and layer and
  2.5's peak of micro-batches in flight;
* **the step time**: one micro-batch's forward ``F`` and backward ``B`` on the busiest chunk
  (the measured per-token compute of a layer, divided by tp and slowed by ranks sharing cores,
  plus each layer's tensor-parallel collectives and ring-attention passes in the fitted
  alpha-beta model of 3.2, plus the pipeline's activation messages), the schedule played on
  paper with those costs (2.5's ``simulate``: its makespan holds the bubble), then the
  data-parallel gradient reduction of the stage's parameters (ring costs; ZeRO's
  reduce-scatters and all-gathers per unit), the optimizer's step on the elements the rank owns,
  and the step's small all-reduces,

and, when the machine's ranks share cores (more ranks per node than ``Rates.cores``, measured with
the shared-core rates), the step from the cores instead: the kernel's scheduler lends each core to
whichever rank can run, so a step takes about every rank's CPU time over the cores
(:func:`rank_cpu`: its layers' compute at its tensor-parallel share, slowed by ``Rates.contention``;
the framework's CPU per pipeline action, collective call and round; each collective's CPU in an
alpha-beta fit of what gloo's threads spend between computations, counted call by call as
``lm.traffic`` counts them), calibrated by the model's own steps measured in the same world
(``lm.anchors``: data parallelism, ZeRO-2, tp2, tp4, tp2+sp at 4 micro-batches, cp2, cp4, cp2 at 4
micro-batches, and 1F1B pipelines of two stages at 2 and 4 micro-batches and of four at 8, at the
planned batch; :func:`calibration` scales the compute and collectives by what data parallelism's
step says, adds ZeRO's measured extra per byte sent, and fits the tp regions' and the ring
attention's whole CPU per call, per round or pass and per byte, and a pipelined rank's per step and
per action), times the share of the cores those steps left idle while ranks waited to be woken. A
layout one of those steps ran exactly, at the planned batch, is predicted by that step's own
measurement (:func:`anchor_of`). A rank slowed by ``ranks / cores`` (the critical path's view)
misses the cores that a pipeline's bubble or a waiting rank leaves to the others, and the links'
times measured there are mostly ranks waiting to be scheduled, which the CPU count already holds.
What it leaves out: the anchors add one kind at a time to data parallelism, every rank busy, so a
layout that combines kinds, or a pipeline whose bubble leaves ranks waiting, pays each kind's CPU as
it was measured alone; ``lm.planner_check`` records where that misses, and how each layout's idle
share differs from the anchors'.

It then adds, for each layout that does not fit, the same layout with activation checkpointing (each
layer keeps its input and recomputes its forward in backward: less memory, one more forward),
drops the layouts that still do not fit the memory, and ranks the rest, fastest first. Every
number in its table says where it came from (:attr:`Prediction.notes`, ``Rates.sources``). The
predictions are checked against measured runs by ``lm/planner_check.py``, whatever they turn
out to be.

What the model leaves out, on purpose and said here: compute and communication never overlap
(the course's executor waits for each message; a GPU run would hide some of it), the backward of
attention costs what the measured layer's did at this sequence length, an MoE layer costs what a
dense one does.

Two kinds of links, when the machine says so (``Machine.inter_node``): a group whose ranks sit on
one node (the topology's rank order puts tp innermost, then cp, dp, pp, and ranks fill nodes in
order) talks over the measured links; a group that spans nodes (any of its ranks on another
node) goes at the slower link's pace, since every step of a ring waits for its slowest hop. That
is what makes Megatron-LM and torchtitan keep tp inside a node. Without it, every group costs
what the measured links cost (one machine, or a plan that does not know better). The states'
bytes per element can be given apart from the activations' (``Machine.states``: mixed-precision
AdamW holds 2 + 2 + 12 bytes per parameter, ``lm.memory.MIXED_ADAMW``).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from course.language_model import LMConfig
from course.topology import RankGrid
from phase4_production.lm_layout import ZERO_BUBBLE, ParallelSettings
from solutions.phase2_advanced.pipeline_schedules import make_schedule, placement_of
from solutions.phase2_advanced.pipeline_study.simulation import simulate
from solutions.phase3_multi_node.alpha_beta import AlphaBeta, Cost, ring_cost
from solutions.phase4_production.lm.anchors import Anchor
from solutions.phase4_production.lm.memory import (
    HeldBytes,
    StateBytes,
    held_bytes,
    rank_stages,
    rank_units,
    split_layers,
)
from solutions.phase4_production.lm.rates import Rates

GIB = 1 << 30


@dataclass(frozen=True)
class Machine:
    """What the plan is for: ranks, ranks per node, the bytes each rank may hold, and (for a
    cluster) the link between nodes and the states' bytes per element."""

    world: int
    ranks_per_node: int
    memory_per_rank: float  # bytes
    element: int = 4  # bytes per element computed and sent: activations, gradients (fp32)
    states: StateBytes | None = None  # bytes per element held; None: AdamW in ``element``
    inter_node: AlphaBeta | None = None  # None: the rates' (measured) one, if any


def spans_nodes(settings: ParallelSettings, ranks_per_node: int, group: str) -> bool:
    """Whether any ``group`` (a :class:`RankGrid` group name) of this layout has ranks on two
    nodes, ranks filling nodes in the topology's order."""
    s = settings
    grid = RankGrid(s.dp, s.tp, s.pp, ranks_per_node, s.cp, s.ep)
    return any(len({rank // ranks_per_node for rank in g}) > 1 for g in grid.groups(group))


@dataclass(frozen=True)
class Prediction:
    """One layout's predicted step and bytes, and what they are made of."""

    settings: ParallelSettings
    seconds: float
    pipeline: float  # the schedule's makespan: forward and backward, bubble included
    gradients: float  # the data-parallel reduction after the step
    optimizer: float
    other: float  # the step's small all-reduces (count, report, clipping norm)
    held: HeldBytes
    fits: bool
    notes: list[str] = field(default_factory=list)
    shared: float | None = None  # every rank's CPU over the cores, when ranks share cores


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    config: LMConfig,
    world: int,
    batch: int,
    *,
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zb-h1"),
    zeros: tuple[int | str, ...] = (0, 2, 3),
    lr: float = 1e-3,
    max_norm: float | None = None,
    per_stage: tuple[int, ...] = (1, 2, 4),
    accumulation: tuple[int, ...] = (1,),
    degrees: Mapping[str, Collection[int]] | None = None,
) -> Iterator[ParallelSettings]:
    """Every layout of ``world`` ranks the settings accept for this model and batch: dp x cp x
    tp x pp = world (ep over dp x cp for an MoE model, the largest that divides the experts),
    sequence parallelism with tp, each schedule with pp and m = k·pp micro-batches for k in
    ``per_stage`` (without pipeline: m in ``accumulation``, gradient accumulation), each ZeRO
    stage with more than one data-parallel rank. ``degrees`` may narrow tp, cp and pp to the
    values a large world is worth searching (``{"tp": (1, 2, 4, 8), "cp": (1,)}``)."""
    allowed = degrees or {}

    def choices(axis: str, n: int) -> list[int]:
        return [d for d in _divisors(n) if axis not in allowed or d in allowed[axis]]

    for tp in choices("tp", world):
        for cp in choices("cp", world // tp):
            for pp in choices("pp", world // (tp * cp)):
                dp = world // (tp * cp * pp)
                ep = 1
                if config.moe_layers:
                    ep = max(d for d in _divisors(dp * cp) if config.num_experts % d == 0)
                for sp in (False, True) if tp > 1 else (False,):
                    for schedule in schedules if pp > 1 else ("1f1b",):
                        for m in [k * pp for k in per_stage] if pp > 1 else accumulation:
                            for zero in zeros if dp * cp > 1 and not config.moe_layers else (0,):
                                settings = ParallelSettings(
                                    dp=dp, cp=cp, tp=tp, pp=pp, ep=ep, sequence_parallel=sp,
                                    schedule=schedule, microbatches=m, zero=zero, lr=lr,
                                    max_norm=max_norm,
                                )  # fmt: skip
                                if not settings.problems(config, batch):
                                    yield settings


def anchor_idle(rates: Rates) -> float:
    """How much longer a step takes than every rank's CPU over the cores: the median over the
    anchor steps (``lm.anchors``), at least 1; 1 without them."""
    if not rates.anchors:
        return 1.0
    return max(1.0, statistics.median(anchor.idle for anchor in rates.anchors))


def anchor_of(
    rates: Rates, config: LMConfig, settings: ParallelSettings, batch: int
) -> Anchor | None:
    """The anchor step that ran exactly this layout (every setting but the learning rate, which
    costs nothing) on this model at this batch, if one did. Its measured CPU and idle share are
    then the prediction, as an autotuner keeps what it timed: the model's parts are for the
    layouts no step has run. At world 8 the first three layouts (dp8, dp4 x pp2, dp2 x pp4)
    lie within a few percent, and the model's ~3% errors picked dp8, whose step is the slower
    of the two that the anchors time directly, in several planner checks."""
    for anchor in rates.anchors:
        same = replace(anchor.settings, lr=settings.lr) == settings
        if same and anchor.model == config and anchor.sequences == batch and anchor.cpu > 0:
            return anchor
    return None


def layout_idle(rates: Rates, settings: ParallelSettings) -> float:
    """How much longer this layout's step takes than every rank's CPU over the cores: the
    median idle share of the anchor steps that ran its kinds (data parallelism's always, and
    those :data:`EXTRAS` lists for ZeRO, tp, cp and the pipeline where the layout has them),
    at least 1; without anchors, :func:`anchor_idle`. Why per layout: how idle the cores sit
    depends on the kinds (ranks that wait at one all-reduce together, a pipeline's ranks that
    take turns; the check's column "measured / (all ranks' CPU / cores)"), and one median for
    all made dp8 and dp4 x pp2 a coin flip at world 8."""
    has = {"zero": bool(settings.zero), "tp": settings.tp > 1, "cp": settings.cp > 1,
           "pp": settings.pp > 1}  # fmt: skip
    kinds = {"dp"}.union(*(EXTRAS[kind][1] for kind, present in has.items() if present))
    found = [anchor.idle for anchor in rates.anchors if anchor.kind in kinds]
    return max(1.0, statistics.median(found)) if found else anchor_idle(rates)


def _collective(link: AlphaBeta, cost: Cost) -> float:
    return cost.time(link.alpha, link.beta)


def _gather_cost(full_bytes: float, n: int) -> Cost:
    """An all-gather or a reduce-scatter of ``full_bytes`` over n ranks on a ring: n - 1 steps,
    (n - 1)/n of the bytes through each link (half of a ring all-reduce)."""
    return Cost(n - 1, (n - 1) / n * full_bytes) if n > 1 else Cost(0, 0)


def predict(
    config: LMConfig,
    settings: ParallelSettings,
    rates: Rates,
    machine: Machine,
    batch: int,
) -> Prediction:
    """The busiest rank's step time and bytes under ``settings`` (see the module doc)."""
    s, e, h = settings, machine.element, config.width
    tp, cp, m = s.tp, s.cp, s.microbatches
    tokens = batch // (s.dp * m) * config.seq_len // cp  # one micro-batch, one rank
    between = tokens // tp if s.sequence_parallel else tokens
    sharing = min(machine.ranks_per_node, machine.world) > rates.cores
    shared_model = sharing and rates.comm_cpu is not None  # the cores' term below holds it
    slowdown = (
        1.0 if shared_model else max(1.0, min(machine.ranks_per_node, machine.world) / rates.cores)
    )
    layer_f, layer_b = _layer_compute(rates, tokens, tp, s.sequence_parallel)
    share = (layer_f + layer_b) / (
        rates.layer_forward.seconds(tokens) + rates.layer_backward.seconds(tokens)
    )
    slow = machine.inter_node if machine.inter_node is not None else rates.inter_node

    def link(group: str, measured: AlphaBeta) -> AlphaBeta:
        if slow is not None and spans_nodes(s, machine.ranks_per_node, group):
            return slow
        return measured

    ar, p2p = rates.all_reduce, rates.point_to_point
    activation = tokens * h * e
    tp_region = _collective(link("tp", ar), ring_cost(activation, tp)) if tp > 1 else 0.0
    block = activation // tp  # one K or V block of the ring
    cp_pass = 2 * _collective(link("cp", p2p), Cost(1, block)) if cp > 1 else 0.0  # K and V
    layers = math.ceil(config.layers / s.virtual_stages)
    forward = layers * (layer_f * slowdown + 2 * tp_region + (cp - 1) * cp_pass)
    backward = layers * (layer_b * slowdown + 2 * tp_region + 2 * (cp - 1) * cp_pass)
    head = rates.head_per_token * tokens * m * slowdown  # the last stage's, on the critical path
    if s.activation_checkpointing:  # backward recomputes the chunk's forward first
        backward += forward
    if s.pp > 1:
        message = _collective(link("pp", p2p), Cost(1, between * h * e))
        forward += message
        backward += message
    schedule = make_schedule(s.schedule, s.pp, m, s.chunks)
    weight = backward / 2 if s.schedule in ZERO_BUBBLE else None
    pipeline = head + (
        simulate(schedule, forward, backward, weight, placement=placement_of(s.schedule)).makespan
        if s.pp > 1
        else m * (forward + backward)
    )
    units = max((rank_units(config, s, r) for r in range(s.pp)), key=sum)
    params = sum(units)
    shards = s.dp * cp
    dp_link = link("dp_cp", ar) if shards > 1 else ar
    if shards == 1:
        gradients = 0.0
    elif s.zero == 0:
        gradients = _collective(dp_link, ring_cost(params * e, shards))
    elif s.zero == 1:  # one reduce-scatter after backward, one all-gather after the step
        gradients = sum(2 * _collective(dp_link, _gather_cost(u * e, shards)) for u in units)
    elif s.zero == 2:
        gradients = sum((m + 1) * _collective(dp_link, _gather_cost(u * e, shards)) for u in units)
    else:
        gradients = sum(3 * m * _collective(dp_link, _gather_cost(u * e, shards)) for u in units)
    owned = params if s.zero == 0 else math.ceil(params / shards)
    optimizer = rates.optimizer_per_element * owned * slowdown
    small = 3 + (4 if s.max_norm is not None else 0)  # count, reports; the norm on each axis
    other = small * ar.alpha
    held = held_bytes(
        config, s, batch, e, rates.activation_bytes_per_token,
        rates.norm_activation_bytes_per_token, machine.states,
    )  # fmt: skip
    notes = [
        f"F {forward * 1e3:.1f} ms, B {backward * 1e3:.1f} ms per micro-batch and chunk "
        f"({tokens} tokens, {layers} layers, compute x{share * slowdown:.2f} of one rank's)",
    ]
    seconds = pipeline + gradients + optimizer + other
    busy = None
    if shared_model:
        measured = anchor_of(rates, config, s, batch)
        if measured is not None:  # this very step was timed: its measurement is the prediction
            work, idle = measured.cpu, max(1.0, measured.idle)
            whence = f"measured by the anchor step {measured.kind!r}"
        else:
            work = sum(rank_cpu(config, s, rates, batch, r, e) for r in range(s.pp)) * (
                s.world_size // s.pp
            )
            idle = layout_idle(rates, s)
            whence = "the anchor steps of its kinds"
        busy = work / rates.cores
        notes.append(
            f"{s.world_size} ranks on {rates.cores} cores: all ranks' CPU {work * 1e3:.1f} ms / "
            f"{rates.cores} = {busy * 1e3:.1f} ms, x{idle:.2f} for the cores left idle "
            f"({whence}); the critical path alone {seconds * 1e3:.1f} ms"
        )
        busy *= idle
        seconds = busy
    return Prediction(
        s,
        seconds,
        pipeline,
        gradients,
        optimizer,
        other,
        held,
        held.total <= machine.memory_per_rank,
        notes,
        busy,
    )


def _layer_compute(
    rates: Rates, tokens: int, tp: int, sequence_parallel: bool
) -> tuple[float, float]:
    """One tp rank's forward and backward seconds for one layer: its measured share
    (``Rates.layer_seconds``), less the norms' work that sequence parallelism divides."""
    forward, backward = rates.layer_seconds(tokens, tp)
    if sequence_parallel and tp > 1:
        norms = rates.norm_share * (1 - 1 / tp)
        forward -= norms * rates.layer_forward.seconds(tokens)
        backward -= norms * rates.layer_backward.seconds(tokens)
    return forward, backward


KINDS = ("tp", "cp", "pp", "dp", "zero")  # the collectives' kinds (:func:`collective_costs`)


def rank_cpu_parts(
    config: LMConfig,
    settings: ParallelSettings,
    rates: Rates,
    batch: int,
    pp_rank: int,
    e: int,
    framework: bool = True,
) -> dict[str, float]:
    """CPU seconds one rank of pipeline rank ``pp_rank`` spends in a step, for a machine whose
    ranks share cores, in parts: ``compute`` (its layers at the tp share times
    ``Rates.contention``, zero-bubble's second walk, recompute, the head, the optimizer on what
    it owns), ``actions`` (the framework's CPU per pipeline action, ``Rates.action_cpu``: F and
    B per micro-batch and chunk, and W under a zero-bubble schedule), and one part per kind of
    collective (:data:`KINDS`): its rounds and bytes at ``Rates.comm_cpu``, counted as
    ``lm.traffic`` counts them, and with ``framework`` the tiny model's ``call_cpu`` per call and
    ``round_cpu`` per round (the anchors, when measured, stand in for those two)."""
    s = settings
    assert rates.comm_cpu is not None
    m = s.microbatches
    tokens = batch // (s.dp * m) * config.seq_len // s.cp
    forward, backward = _layer_compute(rates, tokens, s.tp, s.sequence_parallel)
    runs = split_layers(config.layers, s.virtual_stages)
    last = s.virtual_stages - 1
    zero_bubble = s.schedule in ZERO_BUBBLE
    compute, actions = 0.0, 0
    for stage in rank_stages(s, pp_rank):
        # B for the input, then W again for the weights (measured: Rates.zero_bubble_walks)
        walks = rates.zero_bubble_walks if zero_bubble and stage > 0 else 1.0
        recompute = forward if s.activation_checkpointing else 0.0
        compute += m * len(runs[stage]) * (forward + walks * backward + recompute)
        actions += m * (3 if zero_bubble else 2)
        if stage == last:
            compute += rates.head_per_token * tokens * m
    units = rank_units(config, s, pp_rank)
    owned = sum(units) if s.zero == 0 else math.ceil(sum(units) / (s.dp * s.cp))
    compute += rates.optimizer_per_element * owned
    parts = {"compute": rates.contention * compute, "actions": rates.action_cpu * actions}
    per_call = rates.call_cpu if framework else 0.0
    per_round = rates.comm_cpu.alpha + (rates.round_cpu if framework else 0.0)
    for kind, (cost, calls) in collective_costs(config, s, batch, pp_rank, e).items():
        parts[kind] = per_call * calls + cost.time(per_round, rates.comm_cpu.beta)
    return parts


# Each kind's CPU fitted to the anchors (:class:`Calibration`): its unknowns, in the order a
# fit with fewer anchors than unknowns keeps them, and the anchors (``lm.anchors``) that
# measure them.
EXTRAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tp": (("tp", "tp_round", "tp_byte"), ("tp", "tp4", "tp_micro")),
    "cp": (("cp_call", "cp", "cp_byte"), ("cp", "cp4", "cp_micro")),
    "zero": (("zero_byte",), ("zero",)),
    "pp": (("pp_step", "pp_action"), ("pp", "pp_micro", "pp4")),
}
REPLACED = frozenset({"tp", "cp", "pp"})  # kinds whose fit stands for all their CPU (Calibration)


@dataclass(frozen=True)
class Calibration:
    """What the anchor steps (``lm.anchors``) make of :func:`rank_cpu_parts`: one scale for the
    compute and the collectives' alpha-beta CPU together (``common``), and each other kind's CPU
    in seconds per amount of :func:`_kind_amounts` (``extra``). For the kinds in ``replaced``
    the fit stands for all their CPU, their alpha-beta part is left out (and, for ``pp``, a
    pipelined layout's actions at the tiny model's rate): the tensor-parallel
    regions per call (``tp``), per ring round (``tp_round``) and per byte sent (``tp_byte``);
    the ring attention per call (``cp_call``: each layer's forward and backward, whatever its
    passes), per pass (``cp``) and per byte a pass sends (``cp_byte``). The CPU of those is
    mostly the framework's, not the link's: 3.6's region functions and 2.7's block attention and
    merges, whose cost follows calls and bytes rather than gloo's rounds (the recorded fits,
    ``lm_planner_w*.json``, put more of the ring attention's CPU per call than per pass). ZeRO's
    reduce-scatters and all-gathers add to their alpha-beta CPU per byte sent (``zero_byte``):
    its one anchor shards over the whole world, and priced per call that extra charged ZeRO
    over 2 ranks as much as over 8 (probes: 0.60-0.80x at world 8), priced per ring round it
    charged ZeRO over 2 ranks a third of ZeRO over 4 (1.3x at world 4); a byte sent, (n - 1) / n
    of the unit, lies between and held both worlds. A pipelined rank's own CPU is fitted whole,
    per step (``pp_step``) and per F or B action (``pp_action``: each sends and waits),
    from the three pipeline anchors: the tiny model's CPU per action and the messages' alpha-beta
    CPU undercharged the anchors' pipelines by 6-12% and overcharged pipelines of many
    micro-batches (probes: down to 0.65x at 16), the per-action rate of a model with almost no
    layers standing for this model's actions."""

    common: float = 1.0
    extra: Mapping[str, float] = field(default_factory=dict)  # seconds per call, round, byte...
    replaced: frozenset[str] = frozenset()

    def explained(self, parts: Mapping[str, float], pipelined: bool = False) -> float:
        """The CPU of :func:`rank_cpu_parts`' ``parts`` before the fitted kinds: the actions as
        they are (left out too for a ``pipelined`` layout when ``pp`` is replaced), the rest
        times ``common``, the ``replaced`` kinds left out."""
        scaled = sum(v for part, v in parts.items() if part not in ("actions", *self.replaced))
        actions = 0.0 if pipelined and "pp" in self.replaced else parts["actions"]
        return actions + self.common * scaled


def _kind_amounts(
    config: LMConfig, settings: ParallelSettings, batch: int, pp_rank: int, e: int
) -> dict[str, float]:
    """For one rank: each kind's calls (:data:`KINDS`), ``tp_round`` and ``tp_byte``, the ring
    rounds and bytes sent of its tensor-parallel calls, ``cp_call``, its ring-attention calls
    (each layer's forward and backward: its passes over ``cp - 1``), ``cp_byte``, the bytes
    its passes send (on this rank's ``heads / tp`` heads), ``zero_byte``, the bytes its ZeRO
    calls send, and on a pipelined rank ``pp_step`` (1) and ``pp_action``, its F and B
    actions (each sends a message and waits for one; a zero-bubble W does neither)."""
    s = settings
    costs = collective_costs(config, s, batch, pp_rank, e)
    amounts = {kind: float(calls) for kind, (_, calls) in costs.items()}
    amounts["cp_call"] = amounts["cp"] / (s.cp - 1) if s.cp > 1 else 0.0
    amounts["cp_byte"] = float(costs["cp"][0].bytes_sent)
    amounts["tp_round"] = float(costs["tp"][0].rounds)
    amounts["tp_byte"] = float(costs["tp"][0].bytes_sent)
    amounts["zero_byte"] = float(costs["zero"][0].bytes_sent)
    pipelined = s.pp > 1
    # F and B, each with its message and its wait; W's work is in the compute (its walk)
    actions = s.microbatches * 2 * len(rank_stages(s, pp_rank))
    amounts["pp_step"] = 1.0 if pipelined else 0.0
    amounts["pp_action"] = float(actions) if pipelined else 0.0
    return amounts


def rank_cpu(
    config: LMConfig, settings: ParallelSettings, rates: Rates, batch: int, pp_rank: int, e: int
) -> float:
    """CPU seconds one rank of pipeline rank ``pp_rank`` spends in a step, for a machine whose
    ranks share cores (the kernel lends a core to whichever rank can run, so the step takes about
    every rank's CPU over the cores): :func:`rank_cpu_parts`, calibrated by the model's own
    anchor steps where they were measured (:func:`calibration`; they stand in for the tiny
    model's per-call and per-round constants)."""
    if not rates.anchors:
        return sum(rank_cpu_parts(config, settings, rates, batch, pp_rank, e).values())
    fitted = calibration(rates)
    parts = rank_cpu_parts(config, settings, rates, batch, pp_rank, e, framework=False)
    amounts = _kind_amounts(config, settings, batch, pp_rank, e)
    extra = sum(fitted.extra.get(kind, 0.0) * amount for kind, amount in amounts.items())
    return fitted.explained(parts, settings.pp > 1) + extra


COMMON_RANGE = (0.25, 4.0)  # a common scale outside it says the anchor is noise, not signal
_CALIBRATIONS: dict[int, tuple[Rates, Calibration]] = {}


def _world_parts(anchor: Anchor, rates: Rates) -> tuple[dict[str, float], dict[str, float]]:
    """Every rank's :func:`rank_cpu_parts` (without the tiny model's framework constants) and
    :func:`_kind_amounts` under an anchor's layout, each summed over the world."""
    s = anchor.settings
    e = getattr(torch, rates.dtype).itemsize
    parts: dict[str, float] = {}
    amounts: dict[str, float] = {}
    ranks = s.world_size // s.pp
    for pp_rank in range(s.pp):
        rank = rank_cpu_parts(anchor.model, s, rates, anchor.sequences, pp_rank, e, False)
        for part, seconds in rank.items():
            parts[part] = parts.get(part, 0.0) + seconds * ranks
        for kind, amount in _kind_amounts(anchor.model, s, anchor.sequences, pp_rank, e).items():
            amounts[kind] = amounts.get(kind, 0.0) + amount * ranks
    return parts, amounts


def non_negative_fit(rows: list[tuple[list[float], float]]) -> list[float]:
    """The least-squares ``x >= 0`` of ``sum(a_i x_i) = c`` over ``rows`` of ``(a, c)``, found
    exactly by trying every set of parts allowed above 0 (at most three here; Lawson and
    Hanson's NNLS gives the same answer): each set's least squares, kept when all its parts are
    at least 0, the smallest residual wins. Among fits that leave the same residual (fewer
    anchors than unknowns) the one with the fewest parts, the earlier ones first: a kind
    measured by one anchor puts all of it per call. Columns are scaled to unit length first
    (calls, bytes and elements differ by orders of magnitude)."""
    width = len(rows[0][0])
    a = torch.tensor([row for row, _ in rows], dtype=torch.float64)
    c = torch.tensor([value for _, value in rows], dtype=torch.float64)
    norms = a.norm(dim=0)
    norms[norms == 0] = 1.0
    a = a / norms
    best: tuple[float, list[float]] = (float(c.square().sum()), [0.0] * width)
    for size in range(1, width + 1):
        for kept in map(list, itertools.combinations(range(width), size)):
            columns = a[:, kept]
            if torch.linalg.matrix_rank(columns) < size:
                continue
            x = torch.linalg.lstsq(columns, c.unsqueeze(1)).solution.squeeze(1)
            if bool((x < 0).any()):
                continue
            residual = float((columns @ x - c).square().sum())
            if residual < best[0] - 1e-12 * max(1.0, float(c.square().sum())):
                full = [0.0] * width
                for index, value in zip(kept, x.tolist(), strict=True):
                    full[index] = value / float(norms[index])
                best = (residual, full)
    return best[1]


def calibration(rates: Rates) -> Calibration:
    """:class:`Calibration` from the anchor steps' measured CPU (``Rates.anchors``). Data
    parallelism's anchor gives the common scale: its measured CPU, less the actions, over the
    compute and collectives :func:`rank_cpu_parts` counts (what the layer, contention and link
    rates miss on this machine in common). Each other anchor adds one kind to it: what its
    measurement leaves after the common parts (and, for the kinds in :data:`REPLACED`, without
    their alpha-beta CPU) is fitted over the kind's anchors (:data:`EXTRAS`) by
    :func:`non_negative_fit`. tp2 and tp4 (as many region calls, three times the rounds) and
    tp2 with sequence parallelism at 4 micro-batches (8 times the calls, the same bytes) tell
    the CPU per call, per round and per byte apart; cp2, cp4 (as many ring-attention calls,
    three times the passes at the same bytes per pass) and cp2 at 4 micro-batches (4 times the
    calls and passes, the same bytes in all) the CPU per call, per pass and per byte; ZeRO-2's
    the CPU per byte ZeRO sends; dp ``world / 2`` x pp2 at 2 and 4 micro-batches (twice the
    actions, the same step) and dp ``world / 4`` x pp4 at 8 (a quarter of the layers per stage)
    a pipelined rank's CPU per step and per action, a least-squares fit of three.
    With fewer anchors of a kind, the earlier parts (all of it per call, with one). Without
    anchors: scale 1, nothing extra;
    a common scale outside :data:`COMMON_RANGE` is taken as noise and left at 1."""
    cached = _CALIBRATIONS.get(id(rates))
    if cached is not None and cached[0] is rates:
        return cached[1]
    anchors = {anchor.kind: anchor for anchor in rates.anchors}
    fitted = Calibration()
    if rates.comm_cpu is not None and "dp" in anchors:
        parts, _ = _world_parts(anchors["dp"], rates)
        common = (anchors["dp"].cpu - parts["actions"]) / sum(
            v for part, v in parts.items() if part != "actions"
        )
        low, high = COMMON_RANGE
        common = common if low <= common <= high else 1.0
        extra: dict[str, float] = {}
        replaced = frozenset(k for k in REPLACED if any(a in anchors for a in EXTRAS[k][1]))
        before = Calibration(common, {}, replaced)
        for unknowns, kinds in EXTRAS.values():
            rows = []
            for kind in kinds:
                if kind in anchors:
                    parts, amounts = _world_parts(anchors[kind], rates)
                    pipelined = anchors[kind].settings.pp > 1
                    rest = anchors[kind].cpu - before.explained(parts, pipelined)
                    rows.append(([amounts[u] for u in unknowns], rest))
            if rows:
                extra.update(zip(unknowns, non_negative_fit(rows), strict=True))
        fitted = Calibration(common, extra, replaced)
    _CALIBRATIONS[id(rates)] = (rates, fitted)
    return fitted


def collective_cost(
    config: LMConfig, settings: ParallelSettings, batch: int, pp_rank: int, e: int
) -> tuple[Cost, int]:
    """Every collective and message one rank of pipeline rank ``pp_rank`` takes part in during
    a step: their ring rounds and bytes sent (3.2's ``Cost``) and how many calls (the sum of
    :func:`collective_costs`' kinds)."""
    total, calls = Cost(0, 0), 0
    for cost, count in collective_costs(config, settings, batch, pp_rank, e).values():
        total, calls = total + cost, calls + count
    return total, calls


def collective_costs(
    config: LMConfig, settings: ParallelSettings, batch: int, pp_rank: int, e: int
) -> dict[str, tuple[Cost, int]]:
    """:func:`collective_cost` by kind (:data:`KINDS`): ``tp`` (the tensor-parallel regions'
    all-reduces, or all-gathers and reduce-scatters with sequence parallelism, and the norms'
    gradients), ``cp`` (the ring-attention passes), ``pp`` (the pipeline's messages and its
    report), ``dp`` (the data-parallel gradients' all-reduce, the report and the count) and
    ``zero`` (ZeRO's reduce-scatters and all-gathers, each unit apart), from the calls
    ``lm.traffic``'s formulas count (its module doc). Groups of one rank call nothing."""
    s, h = settings, config.width
    m, tp, cp = s.microbatches, s.tp, s.cp
    act = batch // (s.dp * m) * (config.seq_len // cp) * h * e  # a micro-batch's activation
    between = act // tp if s.sequence_parallel else act
    runs = split_layers(config.layers, s.virtual_stages)
    last = s.virtual_stages - 1
    kinds = {kind: (Cost(0, 0), 0) for kind in KINDS}

    def add(kind: str, cost: Cost, times: int, group: int) -> None:
        if group > 1 and times > 0:
            total, calls = kinds[kind]
            kinds[kind] = (total + Cost(cost.rounds * times, cost.bytes_sent * times),
                           calls + times)  # fmt: skip

    stages = rank_stages(s, pp_rank)
    for stage in stages:
        layers = len(runs[stage])
        passes = 2 if s.schedule in ZERO_BUBBLE and stage > 0 else 1
        regions = 2 * layers * m * (1 + passes)
        if s.sequence_parallel:  # an all-gather and a reduce-scatter per region
            add("tp", _gather_cost(act, tp), 2 * regions, tp)
        else:
            add("tp", ring_cost(act, tp), regions, tp)
        ring_passes = layers * m * (1 + 2 * passes) * (cp - 1)  # K and V (dK and dV) together
        add("cp", Cost(2, 2 * act // tp), ring_passes, cp)
        for neighbour in (stage + 1, stage - 1):
            if 0 <= neighbour <= last and neighbour not in stages:  # activations and gradients
                add("pp", Cost(1, between), 2 * m, s.pp)
                add("pp", Cost(1, 64), 1, s.pp)  # the header
    shards = s.dp * cp
    units = rank_units(config, s, pp_rank)
    add("dp", ring_cost(16, shards), 2, shards)  # the count and the report
    if s.zero == 0:
        add("dp", ring_cost(sum(units) * e, shards), 1, shards)
    else:
        per_unit = {1: 2, 2: m + 1}.get(s.zero, 3 * m) if isinstance(s.zero, int) else 3 * m
        for unit in units:
            add("zero", _gather_cost(unit * e, shards), per_unit, shards)
    add("pp", ring_cost(16, s.pp), 1, s.pp)  # the report over the stages
    if s.sequence_parallel:
        add("tp", ring_cost(16 * h, tp), 2, tp)  # the report; the norms' gradients
    return kinds


def plan(
    config: LMConfig, rates: Rates, machine: Machine, batch: int, **options: object
) -> list[Prediction]:
    """Every candidate predicted, the ones that fit first, each group fastest first."""
    predictions = [
        predict(config, settings, rates, machine, batch)
        for settings in candidates(config, machine.world, batch, **options)  # type: ignore[arg-type]
    ]
    # recompute only where memory asks for it: a layout that does not fit, with checkpointing
    for p in list(predictions):
        recomputed = replace(p.settings, activation_checkpointing=True)
        if not p.fits and not recomputed.problems(config, batch):
            predictions.append(predict(config, recomputed, rates, machine, batch))
    return sorted(predictions, key=lambda p: (not p.fits, p.seconds))
