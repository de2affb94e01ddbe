"""The anchors' calibration of the shared-core model: the model's own steps, measured in the
running world, turn the CPU parts of ``lm.shared_cores`` into the step of a layout no step ran.

The planner prices ranks that share cores by every rank's CPU over the cores
(``lm.shared_cores``: a rank's layers, actions and collectives, each from rates measured apart).
Those parts move from run to run on a shared machine, and one kind's framework code is not
another's (3.6's region functions, 2.7's block merges), so the model's own steps at one layout
per kind (``lm.anchors``: data parallelism, ZeRO-2, tp2, tp4, tp2+sp at 4 micro-batches, cp2,
cp4, cp2 at 4 micro-batches, and 1F1B pipelines of two stages at 2 and 4 micro-batches and of
four at 8) tie them to what this machine does with this model: :func:`calibration` scales the
compute and the collectives by what data parallelism's step says, adds ZeRO's measured extra per
byte sent, and fits the tp regions' and the ring attention's whole CPU per call, per round or
pass and per byte, and a pipelined rank's per step and per action; :func:`rank_cpu` prices a
rank with that fit. Each anchor is priced from its own layout's description
(``lm.layout_work.describe``), as every planned layout is. The idea is the calibration step of
analytical performance models (Hockney's and LogP's parameters are measured, not derived): the
planner keeps its counts and its shape, the machine supplies the constants.

A layout one of those steps ran exactly, at the planned batch, is predicted by that step's own
measurement (:func:`anchor_of`), and the step is every rank's CPU over the cores times the share
of the cores the anchors of its kinds left idle while ranks waited to be woken
(:func:`layout_idle`). What it leaves out: the anchors add one kind at a time to data
parallelism, every rank busy, so a layout that combines kinds, or a pipeline whose bubble leaves
ranks waiting, pays each kind's CPU as it was measured alone; ``lm.planner_check`` records where
that misses.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from course.language_model import LMConfig
from phase4_production.lm_layout import ParallelSettings
from solutions.phase4_production.lm.anchors import Anchor
from solutions.phase4_production.lm.layout_work import LayoutWork, describe
from solutions.phase4_production.lm.rates import Rates
from solutions.phase4_production.lm.shared_cores import kind_amounts, rank_cpu_parts


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
    """What the anchor steps (``lm.anchors``) make of ``rank_cpu_parts``: one scale for the
    compute and the collectives' alpha-beta CPU together (``common``), and each other kind's CPU
    in seconds per amount of ``kind_amounts`` (``extra``). For the kinds in ``replaced``
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
        """The CPU of ``rank_cpu_parts``' ``parts`` before the fitted kinds: the actions as
        they are (left out too for a ``pipelined`` layout when ``pp`` is replaced), the rest
        times ``common``, the ``replaced`` kinds left out."""
        scaled = sum(v for part, v in parts.items() if part not in ("actions", *self.replaced))
        actions = 0.0 if pipelined and "pp" in self.replaced else parts["actions"]
        return actions + self.common * scaled


def rank_cpu(work: LayoutWork, rates: Rates, pp_rank: int) -> float:
    """CPU seconds one rank of pipeline rank ``pp_rank`` spends in the step ``work``
    describes, for a machine whose ranks share cores: ``lm.shared_cores.rank_cpu_parts``,
    calibrated by the model's own anchor steps where they were measured (:func:`calibration`;
    they stand in for the tiny model's per-call and per-round constants)."""
    if not rates.anchors:
        return sum(rank_cpu_parts(work, rates, pp_rank).values())
    fitted = calibration(rates)
    parts = rank_cpu_parts(work, rates, pp_rank, framework=False)
    amounts = kind_amounts(work, pp_rank)
    extra = sum(fitted.extra.get(kind, 0.0) * amount for kind, amount in amounts.items())
    return fitted.explained(parts, work.settings.pp > 1) + extra


COMMON_RANGE = (0.25, 4.0)  # a common scale outside it says the anchor is noise, not signal
_CALIBRATIONS: dict[int, tuple[Rates, Calibration]] = {}


def world_parts(anchor: Anchor, rates: Rates) -> tuple[dict[str, float], dict[str, float]]:
    """Every rank's ``rank_cpu_parts`` (without the tiny model's framework constants) and
    ``kind_amounts`` under an anchor's layout (its description at its batch, in the rates'
    dtype), each summed over the world."""
    s = anchor.settings
    work = describe(anchor.model, s, anchor.sequences, getattr(torch, rates.dtype).itemsize)
    parts: dict[str, float] = {}
    amounts: dict[str, float] = {}
    ranks = s.world_size // s.pp
    for pp_rank in range(s.pp):
        for part, seconds in rank_cpu_parts(work, rates, pp_rank, framework=False).items():
            parts[part] = parts.get(part, 0.0) + seconds * ranks
        for kind, amount in kind_amounts(work, pp_rank).items():
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
    compute and collectives ``rank_cpu_parts`` counts (what the layer, contention and link
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
        parts, _ = world_parts(anchors["dp"], rates)
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
                    parts, amounts = world_parts(anchors[kind], rates)
                    pipelined = anchors[kind].settings.pp > 1
                    rest = anchors[kind].cpu - before.explained(parts, pipelined)
                    rows.append(([amounts[u] for u in unknowns], rest))
            if rows:
                extra.update(zip(unknowns, non_negative_fit(rows), strict=True))
        fitted = Calibration(common, extra, replaced)
    _CALIBRATIONS[id(rates)] = (rates, fitted)
    return fitted
