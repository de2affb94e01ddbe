"""The layout planner: every legal layout of a world, its bytes per rank and its step time,
predicted from the course's own cost models and this machine's measured rates.

Given the model, the global batch, the world (ranks, ranks per node, memory per rank) and the
rates ``lm.rates`` measured, :func:`plan` enumerates the layouts the settings accept (degrees of
dp, cp, tp, pp that fill the world, with sequence parallelism or not, ZeRO stages, pipeline
schedules and micro-batches). For each it writes down once what every rank holds and does in a
step (``lm.layout_work.describe``: stages, units, the schedule, the collectives with their groups
and bytes), and costs that one description twice:

* **the bytes held per rank** (``lm.memory``): parameters, gradients and optimizer state from the
  exact shapes and 3.5's padding; activations from the measured bytes per token and layer and
  2.5's peak of micro-batches in flight;
* **the step time** (:func:`critical_path`): one micro-batch's forward ``F`` and backward ``B``
  on the busiest chunk (the measured per-token compute of a layer, divided by tp and slowed by
  ranks sharing cores, plus each layer's tensor-parallel collectives and ring-attention passes
  in the fitted alpha-beta model of 3.2, plus the pipeline's activation messages), the schedule
  played on paper with those costs (2.5's ``simulate``: its makespan holds the bubble), then the
  data-parallel gradient collectives of the busiest rank (ring costs; ZeRO's reduce-scatters and
  all-gathers per unit), the optimizer's step on the elements the rank owns, and the step's
  small all-reduces,

and, when the machine's ranks share cores (more ranks per node than ``Rates.cores``, measured with
the shared-core rates), the step from the cores instead: the kernel's scheduler lends each core to
whichever rank can run, so a step takes about every rank's CPU time over the cores
(``lm.shared_cores``, priced from the same description), calibrated by the model's own steps
measured in the same world (``lm.anchors``, fitted by ``lm.calibration``), times the share of the
cores those steps left idle while ranks waited to be woken; a layout one of those steps ran
exactly, at the planned batch, is predicted by that step's own measurement. A rank slowed by
``ranks / cores`` (the critical path's view) misses the cores that a pipeline's bubble or a
waiting rank leaves to the others, and the links' times measured there are mostly ranks waiting
to be scheduled, which the CPU count already holds.

It then adds, for each layout that does not fit, the same layout with activation checkpointing (each
layer keeps its input and recomputes its forward in backward: less memory, one more forward),
drops the layouts that still do not fit the memory, and ranks the rest, fastest first. Every
number in its table says where it came from (:attr:`Prediction.notes`, ``Rates.sources``), and
each prediction carries the description it was costed from (:attr:`Prediction.work`). The
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

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field, replace

from course.language_model import LMConfig
from course.topology import RankGrid
from phase4_production.lm_layout import ZERO_BUBBLE, ParallelSettings
from solutions.phase2_advanced.pipeline_schedules import placement_of
from solutions.phase2_advanced.pipeline_study.simulation import simulate
from solutions.phase3_multi_node.alpha_beta import AlphaBeta, Cost
from solutions.phase4_production.lm.calibration import anchor_of, layout_idle, rank_cpu
from solutions.phase4_production.lm.layout_work import LayoutWork, describe
from solutions.phase4_production.lm.memory import HeldBytes, StateBytes, held_bytes
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
    work: LayoutWork | None = None  # the description both models costed (lm.layout_work)
    anchor: str | None = None  # the anchor step whose measurement is the prediction, if one is


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


def shares_cores(machine: Machine, rates: Rates) -> bool:
    """Whether the machine's ranks share cores and the shared-core rates were measured: the
    step is then every rank's CPU over the cores (see the module doc)."""
    return min(machine.ranks_per_node, machine.world) > rates.cores and rates.comm_cpu is not None


@dataclass(frozen=True)
class CriticalPath:
    """The busiest rank's step on dedicated cores, in the parts :class:`Prediction` shows."""

    pipeline: float  # the schedule's makespan: forward and backward, bubble included
    gradients: float  # the data-parallel collectives after the step
    optimizer: float
    other: float  # the step's small all-reduces
    note: str  # what F and B are made of

    @property
    def seconds(self) -> float:
        return self.pipeline + self.gradients + self.optimizer + self.other


def critical_path(work: LayoutWork, rates: Rates, machine: Machine) -> CriticalPath:
    """The step the description ``work`` takes on the busiest rank's critical path (see the
    module doc): the per-micro-batch pieces (``work.micro``) played in the schedule, then the
    busiest rank's gradient collectives, its optimizer step and the small all-reduces, each
    collective on its group's link."""
    s, micro = work.settings, work.micro
    m, cp = s.microbatches, s.cp
    shared_model = shares_cores(machine, rates)  # the cores' term (predict) holds the slowdown
    ranks = min(machine.ranks_per_node, machine.world)
    slowdown = 1.0 if shared_model else max(1.0, ranks / rates.cores)
    layer_f, layer_b = rates.rank_layer_seconds(micro.tokens, s.tp, s.sequence_parallel)
    share = (layer_f + layer_b) / (
        rates.layer_forward.seconds(micro.tokens) + rates.layer_backward.seconds(micro.tokens)
    )
    slow = machine.inter_node if machine.inter_node is not None else rates.inter_node

    def link(group: str, measured: AlphaBeta) -> AlphaBeta:
        if slow is not None and spans_nodes(s, machine.ranks_per_node, group):
            return slow
        return measured

    def time(group: str, measured: AlphaBeta, cost: Cost) -> float:
        chosen = link(group, measured)
        return cost.time(chosen.alpha, chosen.beta)

    ar, p2p = rates.all_reduce, rates.point_to_point
    tp_region = time("tp", ar, micro.region) if s.tp > 1 else 0.0
    cp_pass = time("cp", p2p, micro.ring_pass) if cp > 1 else 0.0  # K and V
    layers = work.layers_per_chunk
    forward = layers * (layer_f * slowdown + 2 * tp_region + (cp - 1) * cp_pass)
    backward = layers * (layer_b * slowdown + 2 * tp_region + 2 * (cp - 1) * cp_pass)
    head = rates.head_per_token * micro.tokens * m * slowdown  # the last stage's
    if s.activation_checkpointing:  # backward recomputes the chunk's forward first
        backward += forward
    if s.pp > 1:
        message = time("pp", p2p, micro.message)
        forward += message
        backward += message
        weight = backward / 2 if s.schedule in ZERO_BUBBLE else None
        placement = placement_of(s.schedule)
        pipeline = head + simulate(work.schedule, forward, backward, weight,
                                   placement=placement).makespan  # fmt: skip
    else:
        pipeline = head + m * (forward + backward)
    busiest = work.busiest
    dp_link = link("dp_cp", ar) if busiest.gradients else ar
    gradients = sum(
        (c.calls * c.cost.time(dp_link.alpha, dp_link.beta) for c in busiest.gradients), 0.0
    )
    optimizer = rates.optimizer_per_element * busiest.owned * slowdown
    note = (
        f"F {forward * 1e3:.1f} ms, B {backward * 1e3:.1f} ms per micro-batch and chunk "
        f"({micro.tokens} tokens, {layers} layers, compute x{share * slowdown:.2f} of one rank's)"
    )
    return CriticalPath(pipeline, gradients, optimizer, work.small_all_reduces * ar.alpha, note)


def predict(
    config: LMConfig,
    settings: ParallelSettings,
    rates: Rates,
    machine: Machine,
    batch: int,
) -> Prediction:
    """The busiest rank's step time and bytes under ``settings`` (see the module doc): the
    layout described once, its bytes (``lm.memory``) and its time (:func:`critical_path`, or
    every rank's CPU over the cores when they share them) costed from that description."""
    s = settings
    work = describe(config, s, batch, machine.element)
    held = held_bytes(work, rates.activation_bytes_per_token,
                      rates.norm_activation_bytes_per_token, machine.states)  # fmt: skip
    path = critical_path(work, rates, machine)
    seconds, notes = path.seconds, [path.note]
    busy, measured = None, None
    if shares_cores(machine, rates):
        measured = anchor_of(rates, config, s, batch)
        if measured is not None:  # this very step was timed: its measurement is the prediction
            cpu, idle = measured.cpu, max(1.0, measured.idle)
            whence = f"measured by the anchor step {measured.kind!r}"
        else:
            cpu = sum(rank_cpu(work, rates, r) for r in range(s.pp)) * (s.world_size // s.pp)
            idle = layout_idle(rates, s)
            whence = "the anchor steps of its kinds"
        busy = cpu / rates.cores
        notes.append(
            f"{s.world_size} ranks on {rates.cores} cores: all ranks' CPU {cpu * 1e3:.1f} ms / "
            f"{rates.cores} = {busy * 1e3:.1f} ms, x{idle:.2f} for the cores left idle "
            f"({whence}); the critical path alone {seconds * 1e3:.1f} ms"
        )
        busy *= idle
        seconds = busy
    return Prediction(
        s, seconds, path.pipeline, path.gradients, path.optimizer, path.other, held,
        held.total <= machine.memory_per_rank, notes, busy, work,
        None if measured is None else measured.kind,
    )  # fmt: skip


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
