"""What 3.5's namers know (issue 49, tests/mistake_tables.py): ``ZeroUnit.reduce_scatter``.

Before training, every graded ZeRO world tries the learner's ``ZeroUnit`` methods alone on
values that show where each element came from (``zero_helpers.unit_problems``): every group
rank r hands in ``arange(padded) * (r + 1)``, and its slice of the group's mean must come back.
``reduce_scatter_problem`` words what came back. A mistaken reduce-scatter is one value per
factor: what the sum is divided by, and which slice is kept. The worlds of 2, 3 and 4 and the
two groups of 2 in a world of 4 (graded in the subgroup test) make a division by the world
differ from one by the group, and the global rank's slice from the group rank's.

The other 3.5 failures (ten steps against one process's AdamW, bytes against the paper's
formulas, collective volumes, the FSDP-style units' dtypes, gathers and prefetch order) say
what differs from what was expected; their named remarks (summed gradients, stale or misplaced
slices, a freed parameter) are each decided by one measurement that no other mistake here
produces, and are checked by the graders' own tests against the reference.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

import grade_3_5_zero as grader
from mistake_tables import KnownMistake, NamerTable
from phase3_helpers import factor_neighbours
from zero_helpers import reduce_scatter_problem

Settings = dict[str, Any]
FIRST_UNIT = 6 * 7 + 7  # small_mlp's first layer: the unit unit_problems tries
WORLDS = sorted({world for _, world in grader.CASES})
GROUPS = f"groups of {grader.SUBGROUP_SIZE} in a world of {grader.SUBGROUP_WORLD}"
CASES = (*(f"world {w}" for w in WORLDS), GROUPS)
FACTORS = {
    "divided by": ("the group's size", "nothing", "the world's size"),
    "slice": ("the group rank's", "the global rank's", "none: the whole buffer"),
}
RIGHT = {f: vs[0] for f, vs in FACTORS.items()}


def layout(case: str) -> tuple[int, int]:
    """(group size, world size) of a case."""
    if case == GROUPS:
        return grader.SUBGROUP_SIZE, grader.SUBGROUP_WORLD
    world = int(case.split()[-1])
    return world, world


def inputs(group_size: int) -> tuple[torch.Tensor, int]:
    """The sum of the group's flat gradients as unit_problems builds them, and the slice size."""
    padded = -(-FIRST_UNIT // group_size) * group_size
    full = [torch.arange(padded, dtype=torch.float64) * (r + 1) for r in range(group_size)]
    return torch.stack(full).sum(0), padded // group_size


def mistaken_reduce_scatter(
    total: torch.Tensor, size: int, rank: int, global_rank: int, world: int, s: Settings
) -> torch.Tensor:
    """reduce_scatter as a learner might write it (the sum over the group, then a slice and a
    division), with the choices of ``s``; ``size`` the slice length."""
    group_size = total.numel() // size
    divisor = {"the group's size": group_size, "nothing": 1, "the world's size": world}
    kept = {
        "the group rank's": total[rank * size : (rank + 1) * size],
        "the global rank's": total[global_rank * size : (global_rank + 1) * size],
        "none: the whole buffer": total,
    }[s["slice"]]
    return kept / divisor[s["divided by"]]


def measure(s: Settings) -> dict[str, list[torch.Tensor]]:
    """Every global rank's returned slice, per case."""
    out = {}
    for case in CASES:
        group_size, world = layout(case)
        total, size = inputs(group_size)
        out[case] = [
            mistaken_reduce_scatter(total, size, g % group_size, g, world, s) for g in range(world)
        ]
    return out


def name(measured: dict[str, list[torch.Tensor]]) -> str | None:
    """The first rank's words in the first failing case, as unit_problems words them."""
    for case in CASES:
        group_size, world = layout(case)
        total, _ = inputs(group_size)
        for g, got in enumerate(measured[case]):
            said = reduce_scatter_problem(got, total, g % group_size, g, group_size, world)
            if said:
                return said
    return None


MISTAKES = (
    (KnownMistake("summed", "a factor group size: not divided", CASES[0],
                  "it is the sum, divide by the group size"), {"divided by": "nothing"}),
    (KnownMistake("world_mean", "world for group", GROUPS,
                  "divided by the WORLD's size"), {"divided by": "the world's size"}),
    (KnownMistake("global_rank_slice", "the global rank for the group rank", GROUPS,
                  "it is the slice of the GLOBAL rank"), {"slice": "the global rank's"}),
    (KnownMistake("whole_buffer", "no slice: the whole buffer", CASES[0],
                  "it is the whole mean buffer"), {"slice": "none: the whole buffer"}),
)  # fmt: skip
SETTINGS = {m.key: {**RIGHT, **changed} for m, changed in MISTAKES}

TABLES = (
    NamerTable(
        exercise="3.5",
        function="ZeroUnit.reduce_scatter",
        factors=tuple(f"{f}: {', '.join(vs)}" for f, vs in FACTORS.items()),
        cases=CASES,
        mistakes=tuple(m for m, _ in MISTAKES),
        right=lambda: measure(RIGHT),
        plant=lambda key: measure(SETTINGS[key]),
        name=name,
        neighbours=lambda key: factor_neighbours(SETTINGS[key], RIGHT, FACTORS, measure),
    ),
)
