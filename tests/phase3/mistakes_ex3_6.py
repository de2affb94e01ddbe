"""What 3.6's namers know (issue 49, tests/mistake_tables.py): the norm of ``clip_grad_norm_``
over shards, and ``replica_batch``.

``global_grad_norm``: a mistake is one value per factor: for each group (pp, tp, dp, cp) whether
its partial sums are reduced and whether its copies are counted once, and how the norm of the
parts is taken (the p of the power and the root, the absolute value, the inf-norm's MAX). Each
is simulated on the pieces every rank holds in the grader's layouts (imported from the grader's
helpers: 3D, with context parallelism, ZeRO slices), for every norm type the grader asks, and
named by the grader's own ``norm_problem``. The layouts have groups of the same size that hold
other ranks (tp2 x dp2, tp2 x pp2, dp2 x pp2, cp2 x tp2, cp2 x pp2), so a sum over the wrong
group of the same size shows on the ranks' values.

``replica_batch``: the replica's slice of the batch, tried for dp = 1..4 (dp = 3 and 4 make a
slice of replica 0 and the whole batch differ from every other mistake).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

import grade_3_6_clipping as clip_grader
import grade_3_6_parallel_3d as p3d_grader
from clip_helpers import (
    LAYOUTS,
    NORMS,
    Layout,
    Rules,
    _held,
    dense_grads,
    norm_name,
    simulate,
)
from mistake_tables import KnownMistake, NamerTable, same_measurement
from phase3_helpers import factor_neighbours

Settings = dict[str, Any]


def _table(
    exercise_function: str,
    factors: Mapping[str, Sequence[Any]],
    right: Settings,
    mistakes: Sequence[tuple[str, str, str, Settings]],
    cases: tuple[str, ...],
    measure: Callable[[Settings], Any],
    name: Callable[[Any], str | None],
) -> NamerTable:
    """A table whose mistakes are ``right`` with a few factors changed; each mistake's
    ``separated_by`` is the first graded case where it measures unlike the right answer and
    every other mistake (computed, so that it stays true when the cases change)."""
    settings = {key: {**right, **changed} for key, _, _, changed in mistakes}
    planted = {key: measure(s) for key, s in settings.items()}
    want = measure(right)

    def separating(key: str) -> str:
        for case in cases:
            mine = planted[key][case]
            others = [planted[o][case] for o in planted if o != key] + [want[case]]
            if not any(same_measurement(mine, other) for other in others):
                return case
        return cases[0]

    return NamerTable(
        exercise="3.6",
        function=exercise_function,
        factors=tuple(f"{f}: {', '.join(map(str, vs))}" for f, vs in factors.items()),
        cases=cases,
        mistakes=tuple(
            KnownMistake(key, off_by, separating(key), says) for key, off_by, says, _ in mistakes
        ),
        right=lambda: want,
        plant=lambda key: planted[key],
        name=name,
        neighbours=lambda key: factor_neighbours(settings[key], right, factors, measure),
    )


# ----------------------------------------------------------------------------- global_grad_norm


NORM_CASES = tuple(layout.label for layout in LAYOUTS)
COPY_CHOICES = ("reduced, counted once", "not reduced", "reduced, counted on every rank")
NORM_FACTORS: dict[str, tuple[str, ...]] = {
    "all-reduce": ("over each group", "none at all"),
    "pp": ("reduced", "not reduced"),
    "tp": COPY_CHOICES,
    "dp": COPY_CHOICES,
    "cp": COPY_CHOICES,
    "finite p": ("right", "two", "pow2", "root2", "noroot", "rootfirst", "combine2", "noabs"),
    "inf": ("right", "sum", "signed", "signed_sum", "powpath"),
}
NORM_RIGHT = {f: vs[0] for f, vs in NORM_FACTORS.items()}


@cache
def _held_of(layout: Layout, norm_type: float) -> Any:
    return _held(layout, norm_type, dense_grads())


def rules_of(s: Settings, inf: bool) -> Rules:
    """The simulator's rules for the mistake ``s``: which groups' copies are counted once
    (skip), which groups are reduced, the way the norm is taken."""
    skip = {a for a in ("tp", "dp", "cp") if s[a] != "reduced, counted on every rank"}
    reduce = {a for a in ("pp", "tp", "dp", "cp") if s[a] != "not reduced"}
    if s["all-reduce"] == "none at all":
        reduce = set()
    return Rules(frozenset(skip), frozenset(reduce), s["inf"] if inf else s["finite p"])


def measure_norm(s: Settings) -> dict[str, dict[str, tuple[float, ...]]]:
    """The norm every rank returns, per graded layout and norm type."""
    out: dict[str, dict[str, tuple[float, ...]]] = {}
    for layout in LAYOUTS:
        out[layout.label] = {
            norm_name(p): tuple(
                simulate(layout, p, rules_of(s, math.isinf(p)), _held_of(layout, p))
            )
            for p in NORMS
        }
    return out


def name_norm(measured: dict[str, dict[str, tuple[float, ...]]]) -> str | None:
    """What the learner reads first: the first layout's first wrong norm, in the grader's words
    (norm_problem, which layout_problems calls)."""
    for layout in LAYOUTS:
        for p in NORMS:
            elsewhere = [
                (other, list(measured[other.label][norm_name(p)]))
                for other in LAYOUTS
                if other != layout
            ]
            wrong = clip_grader.norm_problem(
                layout, p, list(measured[layout.label][norm_name(p)]), dense_grads(), elsewhere
            )
            if wrong is not None:
                return f"3.6 clip_grad_norm_ over {layout.label}: {wrong[0]}"
    return None


NORM = _table(
    "global_grad_norm",
    NORM_FACTORS,
    NORM_RIGHT,
    [
        ("local_only", "every group: no reduction", "local norm only",
         {"all-reduce": "none at all"}),
        ("pp_not_reduced", "the pp group", "the pipeline stages were not reduced",
         {"pp": "not reduced"}),
        ("tp_not_reduced", "the tp group", "the tp pieces were not reduced",
         {"tp": "not reduced"}),
        ("dp_not_reduced", "the dp group", "the dp group was not reduced",
         {"dp": "not reduced"}),
        ("cp_not_reduced", "the cp group", "the cp group was not reduced",
         {"cp": "not reduced"}),
        ("tp_copies_counted", "a factor tp on the tp-replicated bias",
         "fc2.bias was counted 2 times", {"tp": "reduced, counted on every rank"}),
        ("dp_copies_counted", "a factor dp on every copy", "the dp replicas were counted",
         {"dp": "reduced, counted on every rank"}),
        ("cp_copies_counted", "a factor cp on the cp copies", "the copies along cp were counted",
         {"cp": "reduced, counted on every rank"}),
        ("p_two", "the p of the norm: 2", "the 2-norm was computed, not the", {"finite p": "two"}),
        ("power_two", "the p of the power: 2", "was squared, not raised to the power",
         {"finite p": "pow2"}),
        ("root_two", "the p of the root: 2", "a square root ended it", {"finite p": "root2"}),
        ("no_root", "the root missing", "the root is missing", {"finite p": "noroot"}),
        ("root_per_rank", "the root before the sum", "was taken on each rank before the sum",
         {"finite p": "rootfirst"}),
        ("combined_as_two", "the parts combined as a 2-norm", "combined with the others' as a",
         {"finite p": "combine2"}),
        ("no_abs", "the absolute value missing", "the absolute value is missing",
         {"finite p": "noabs"}),
        ("inf_summed", "the inf-norm's MAX: a SUM", "the inf-norm was summed", {"inf": "sum"}),
        ("inf_signed", "the inf-norm's |g|: g", "the largest g was taken, not the largest |g|: "
         "the inf-norm is the max", {"inf": "signed"}),
        ("inf_signed_summed", "|g| and MAX both", "were summed (the inf-norm is a MAX",
         {"inf": "signed_sum"}),
        ("inf_as_power", "inf through the finite-p path", "went through the finite-p path",
         {"inf": "powpath"}),
    ],
    NORM_CASES,
    measure_norm,
    name_norm,
)  # fmt: skip


# ----------------------------------------------------------------------------- replica_batch


BATCH = torch.arange(24.0).reshape(12, 2)
REPLICA_CASES = tuple(f"dp_size={dp}" for dp in p3d_grader.REPLICA_DP_SIZES)
REPLICA_FACTORS = {
    "start": ("dp_rank x size", "0", "dp_rank", "(dp - 1 - dp_rank) x size"),
    "length": ("12 // dp", "12", "dp", "12 // dp + 1"),
}
REPLICA_RIGHT = {f: vs[0] for f, vs in REPLICA_FACTORS.items()}


def mistaken_replica_batch(batch: torch.Tensor, dp_rank: int, dp: int, s: Settings) -> torch.Tensor:
    n = batch.shape[0]
    size = n // dp
    start = {"dp_rank x size": dp_rank * size, "0": 0, "dp_rank": dp_rank,
             "(dp - 1 - dp_rank) x size": (dp - 1 - dp_rank) * size}[s["start"]]  # fmt: skip
    length = {"12 // dp": size, "12": n, "dp": dp, "12 // dp + 1": size + 1}[s["length"]]
    return batch[start : start + length]


def measure_replica(s: Settings) -> dict[str, list[torch.Tensor]]:
    return {
        f"dp_size={dp}": [mistaken_replica_batch(BATCH, r, dp, s) for r in range(dp)]
        for dp in p3d_grader.REPLICA_DP_SIZES
    }


def name_replica(measured: dict[str, list[torch.Tensor]]) -> str | None:
    for dp in p3d_grader.REPLICA_DP_SIZES:
        problem = p3d_grader.replica_batch_problem(BATCH, measured[f"dp_size={dp}"], dp)
        if problem:
            return problem
    return None


REPLICA = _table(
    "replica_batch",
    REPLICA_FACTORS,
    REPLICA_RIGHT,
    [
        ("whole_batch", "the length: the whole batch", "every replica got the whole batch",
         {"start": "0", "length": "12"}),
        ("replica_zero", "the start: always 0", "every replica got replica 0's samples",
         {"start": "0"}),
    ],
    REPLICA_CASES,
    measure_replica,
    name_replica,
)  # fmt: skip

# ----------------------------------------------------------------------------- the dp average


COMM_CASES = tuple(p3d_grader.IDS)
COMM_FACTORS = {
    "gradients all-reduced on": ("the dp group", "the tp group", "the pp group", "the world",
                                 "nothing", "the dp group twice"),
}  # fmt: skip
COMM_RIGHT = {f: vs[0] for f, vs in COMM_FACTORS.items()}


def rank0_groups(dp: int, tp: int, pp: int) -> dict[str, tuple[int, ...]]:
    """Rank 0's groups in the course's order (pp slowest, tp fastest)."""
    return {
        "tp": tuple(range(tp)),
        "dp": tuple(range(0, dp * tp, tp)),
        "pp": tuple(range(0, pp * dp * tp, dp * tp)),
    }


def comm_run(dp: int, tp: int, pp: int, s: Settings) -> Any:
    """Rank 0's records of one step (stage 0): the tp all-reduces (g forward, f backward, less
    the first block's f), the activations and the header to the next stage, and the gradient
    average where ``s`` puts it."""
    from parallel_3d_helpers import BLOCKS, ELEMENT, FFN, GLOBAL_BATCH, HIDDEN, MICROBATCHES, Run3D

    groups = rank0_groups(dp, tp, pp)
    per = BLOCKS // pp
    act = GLOBAL_BATCH // dp // MICROBATCHES * HIDDEN * ELEMENT
    shard = FFN // tp
    grad_bytes = per * (shard * HIDDEN + shard + HIDDEN * shard + HIDDEN) * ELEMENT
    records: list[tuple[str, int, tuple[int, ...] | None, int | None]] = [
        ("all_reduce", act, groups["tp"], None) for _ in range((2 * per - 1) * MICROBATCHES)
    ]
    if pp > 1:
        records += [("isend", act, None, groups["pp"][1])] * MICROBATCHES
        records.append(("isend", p3d_grader.HEADER_BYTES, None, groups["pp"][1]))
    world = tuple(range(dp * tp * pp))
    on = {
        "the dp group": [groups["dp"]],
        "the tp group": [groups["tp"]],
        "the pp group": [groups["pp"]],
        "the world": [world],
        "nothing": [],
        "the dp group twice": [groups["dp"], groups["dp"]],
    }[s["gradients all-reduced on"]]
    records += [("all_reduce", grad_bytes, ranks, None) for ranks in on]
    return Run3D(coords=(0, 0, 0), groups=groups, records=records, grad_bytes=grad_bytes)


def measure_comm(s: Settings) -> dict[str, list[tuple[Any, ...]]]:
    return {
        label: comm_run(dp, tp, pp, s).records
        for label, (dp, tp, pp) in zip(COMM_CASES, p3d_grader.CASES, strict=True)
    }


def name_comm(measured: dict[str, list[tuple[Any, ...]]]) -> str | None:
    """comm_problems on rank 0 of the first layout where it finds any."""
    for label, (dp, tp, pp) in zip(COMM_CASES, p3d_grader.CASES, strict=True):
        run = comm_run(dp, tp, pp, COMM_RIGHT)
        run.records = list(measured[label])
        problems = p3d_grader.comm_problems(run, 0, dp, tp, pp)
        if problems:
            return f"{label}: " + "; ".join(problems)
    return None


COMM = _table(
    "Parallel3D.train_step (the gradient average)",
    COMM_FACTORS,
    COMM_RIGHT,
    [
        ("on_tp", "the group: tp for dp", "all-reduced its", {"gradients all-reduced on": "the tp group"}),
        ("on_pp", "the group: pp for dp", "on its pp group",
         {"gradients all-reduced on": "the pp group"}),
        ("on_world", "the group: the world for dp", "the gradient average must run on the dp group",
         {"gradients all-reduced on": "the world"}),
        ("none", "no average", "no gradient average on the dp group",
         {"gradients all-reduced on": "nothing"}),
        ("twice", "averaged twice", "the gradients were averaged twice",
         {"gradients all-reduced on": "the dp group twice"}),
    ],
    COMM_CASES,
    measure_comm,
    name_comm,
)  # fmt: skip

TABLES = (NORM, REPLICA, COMM)
