"""4.2's namer and what it knows (issue 49): ``resume(manager, state, group=)`` on the groups
(0, 1) and (2, 3) of a world of 4, each group with its own checkpoints and its rank 1 looking
at the folder before the newest was complete; the realistic mistakes, each off by one rank or
one group, and what each rank reports (an error, the step resumed, whose generators it drew).

The reports are planted here by a resume of our own with one switch per factor (the errors
are torch's and Python's own words for the same mistakes).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:  # loaded by path: the grader's folder
    sys.path.insert(0, str(Path(__file__).parent))
from grade_4_2_recovery import SUBGROUP_STEPS, subgroup_resume_verdict
from mistake_tables import KnownMistake, NamerTable, one_factor_away

FACTORS: dict[str, tuple[str, ...]] = {
    "generators restored": ("the global rank's", "the group rank's", "rank 0's", "none"),
    "broadcast src": ("the group's rank 0, as a global rank", "0, the group rank"),
    "step taken": ("the group's rank 0's choice", "its own look"),
}
RIGHT = {factor: values[0] for factor, values in FACTORS.items()}
KNOWN = {
    "rng by group rank": {"generators restored": "the group rank's"},
    "src as group rank": {"broadcast src": "0, the group rank"},
    "own look": {"step taken": "its own look"},
}
CASE = "groups (0, 1) and (2, 3) of 4"
WHAT = "4.2 resume(manager, state, group=) in a world of 4"


def report(rank: int, s: dict[str, str]) -> dict[str, Any]:
    ranks = (0, 1) if rank < 2 else (2, 3)
    group_rank = ranks.index(rank)
    if s["broadcast src"] == "0, the group rank" and 0 not in ranks:
        return {"ranks": ranks, "error": "ValueError: Global rank 0 is not part of group <pg>"}
    restored = s["generators restored"]
    if restored == "the group rank's" and group_rank not in ranks:
        return {"ranks": ranks, "error": f"KeyError: 'rank{group_rank}/torch'"}
    older, newest = SUBGROUP_STEPS[rank // 2]
    step = older if s["step taken"] == "its own look" and group_rank == 1 else newest
    took = {
        "the global rank's": [rank],
        "the group rank's": [group_rank],
        "rank 0's": [0],
        "none": [],
    }[restored]
    return {"ranks": ranks, "error": None, "step": step, "took": took}


def measure(changes: dict[str, str]) -> list[dict[str, Any]]:
    return [report(rank, RIGHT | changes) for rank in range(4)]


def name(measured: list[dict[str, Any]]) -> str | None:
    return subgroup_resume_verdict(measured, WHAT)


def neighbours(key: str) -> Sequence[tuple[str, Any]]:
    return one_factor_away(KNOWN[key], KNOWN.values(), RIGHT, FACTORS, measure)


TABLES = (
    NamerTable(
        exercise="4.2",
        function="resume (group=)",
        factors=tuple(f"{f} ({' / '.join(v)})" for f, v in FACTORS.items()),
        cases=(CASE,),
        mistakes=(
            KnownMistake(
                "rng by group rank",
                "the group's rank for the global",
                CASE,
                "its rank in the group",
            ),
            KnownMistake(
                "src as group rank",
                "src: the group's rank for the global",
                CASE,
                "names a global rank",
            ),
            KnownMistake(
                "own look", "its own folder look for rank 0's", CASE, "its own look at the folder"
            ),
        ),
        right=lambda: measure({}),
        plant=lambda key: measure(KNOWN[key]),
        name=name,
        neighbours=neighbours,
    ),
)
