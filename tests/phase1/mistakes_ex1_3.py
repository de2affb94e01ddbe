"""1.3's namer and what it knows (issue 49): the census of contributions (rank r's tensor all
10^r, so each digit of a rank's result counts one rank's contribution) and the realistic
mistakes of a rank combining what it received, each off by one factor of how it combines.

The mistakes are planted by a direct exchange of our own, one switch per factor, on the worlds
of 3 and 4 the grader runs; what it measures is every rank's value, which the census reads.

The subgroup checks have no table: they list, and name no single cause.

- A wrong sum inside the groups (0, 1) and (2, 3) lists the causes that fit, names none: the
  world's sum passed, so what is left is a size or a rank taken from the world, which it lists
  together (a missing group= or a peer not mapped to its global rank crosses the group, and
  only_inside fails that call first, naming the call).
- A hang in the groups lists the three things a subgroup needs (group= on every collective, the
  group's size and rank, global peers), names none: a hang carries no evidence of which.
- The byte counts (what each rank sent and received against the strategy's rule) describe, name
  no cause.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:  # loaded by path: the grader's folder
    sys.path.insert(0, str(Path(__file__).parent))
from grade_1_3_all_reduce import census_remark, contribution_counts
from mistake_tables import KnownMistake, NamerTable, one_factor_away

FACTORS: dict[str, tuple[str, ...]] = {
    "start": ("own tensor", "zeros", "own tensor, added again"),
    "receive buffers": ("one per peer", "one shared by every peer"),
}
RIGHT = {factor: values[0] for factor, values in FACTORS.items()}
KNOWN = {
    "overwritten": {"receive buffers": "one shared by every peer"},
    "own missing": {"start": "zeros"},
    "own twice": {"start": "own tensor, added again"},
}
WORLDS = (3, 4)
CASES = tuple(f"{w} ranks" for w in WORLDS)


def combined(rank: int, world: int, setting: dict[str, str]) -> float:
    """Rank ``rank``'s result: its start, plus what it combined from each peer."""
    own = 10.0**rank
    total = {"own tensor": own, "zeros": 0.0, "own tensor, added again": 2 * own}[setting["start"]]
    peers = [10.0**p for p in range(world) if p != rank]
    if setting["receive buffers"] == "one shared by every peer":
        peers = [peers[-1]] * len(peers)  # the last arrival overwrote the others
    return total + sum(peers)


def measure(changes: dict[str, str]) -> dict[str, list[float]]:
    setting = RIGHT | changes
    return {f"{w} ranks": [combined(r, w, setting) for r in range(w)] for w in WORLDS}


def name(measured: dict[str, list[float]]) -> str | None:
    """The census lines the grader writes, every case in its order."""
    lines = []
    for world in WORLDS:
        for rank, value in enumerate(measured[f"{world} ranks"]):
            counts = contribution_counts(value, world)
            if counts is None:
                lines.append(f"{world} ranks, rank {rank}: {value!r} is no sum of the inputs")
            elif counts != [1] * world:
                lines.append(f"{world} ranks, rank {rank}: {census_remark(counts)}")
    return "\n".join(lines) or None


def neighbours(key: str) -> Sequence[tuple[str, Any]]:
    return one_factor_away(KNOWN[key], KNOWN.values(), RIGHT, FACTORS, measure)


TABLES = (
    NamerTable(
        exercise="1.3",
        function="direct_exchange_all_reduce / reduce_broadcast_all_reduce (census)",
        factors=tuple(f"{f} ({' / '.join(v)})" for f, v in FACTORS.items()),
        cases=CASES,
        mistakes=(
            KnownMistake(
                "overwritten",
                "one receive buffer for every peer",
                "3 ranks",
                "was overwritten by another",
            ),
            KnownMistake(
                "own missing", "the own tensor, -1", "3 ranks", "a contribution was never"
            ),
            KnownMistake(
                "own twice", "the own tensor, +1", "3 ranks", "a contribution was combined more"
            ),
        ),
        right=lambda: measure({}),
        plant=lambda key: measure(KNOWN[key]),
        name=name,
        neighbours=neighbours,
    ),
)
