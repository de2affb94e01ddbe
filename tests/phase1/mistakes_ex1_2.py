"""1.2's namer and what it knows (issue 49): ``average_gradients``' realistic mistakes, each off
by the number it divides by, and the graded case that tells it from the others.

The grader gives rank r gradients all r+1 and reads back one value per rank: on 2 ranks, on 4,
and inside the groups (0, 1) and (2, 3) of a world of 4, where the same run also averages over
the whole world (a group of 2 in a world of 4 halves the mean both when it divides by the
world's size and when it divides by the group's twice; only the whole world tells them apart).
The mistakes are planted here by an averaging of our own with one switch per factor.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).parent) not in sys.path:  # loaded by path: the grader's folder
    sys.path.insert(0, str(Path(__file__).parent))
from grade_1_2_averaging import REDUCED, check_mean
from mistake_tables import KnownMistake, NamerTable, one_factor_away

FACTORS: dict[str, tuple[str, ...]] = {
    "divisor": ("group size", "nothing", "world size", "group size twice"),
    "op": ("sum", "max"),
}
RIGHT = {factor: values[0] for factor, values in FACTORS.items()}
KNOWN = {
    "sum": {"divisor": "nothing"},
    "world size": {"divisor": "world size"},
    "twice": {"divisor": "group size twice"},
}
CASES = ("2 ranks", "4 ranks", "groups (0, 1), (2, 3) of 4")
GROUP = (0, 1)  # the grader reads every rank; rank 0's group is enough to tell the mistakes apart


def averaged(members: Sequence[int], world: int, setting: dict[str, str]) -> float:
    """What a rank of the group ``members`` holds after averaging gradients all r+1."""
    values = [float(r + 1) for r in members]
    combined = sum(values) if setting["op"] == "sum" else max(values)
    divisor = {
        "group size": len(members),
        "nothing": 1,
        "world size": world,
        "group size twice": len(members) ** 2,
    }[setting["divisor"]]
    return combined / divisor


def measure(changes: dict[str, str]) -> dict[str, Any]:
    setting = RIGHT | changes
    return {
        "2 ranks": averaged(range(2), 2, setting),
        "4 ranks": averaged(range(4), 4, setting),
        "groups (0, 1), (2, 3) of 4": (
            averaged(GROUP, 4, setting),
            averaged(range(4), 4, setting) / 2.5,
        ),
    }


def _grads(value: float) -> dict[str, torch.Tensor | None]:
    grads: dict[str, torch.Tensor | None] = {
        name: torch.full((3,), value, dtype=torch.float64) for name in REDUCED
    }
    return grads | {"frozen.weight": None, "unused.weight": None}


def name(measured: dict[str, Any]) -> str | None:
    """The grader's words on every case, in its order (each case is its own test)."""
    problems = check_mean(_grads(measured["2 ranks"]), 1.5, "2 ranks", 2, 2)
    problems += check_mean(_grads(measured["4 ranks"]), 2.5, "4 ranks", 4, 4)
    got, whole = measured["groups (0, 1), (2, 3) of 4"]
    problems += check_mean(_grads(got), 1.5, "group (0, 1)", 2, 4, whole)
    return "\n".join(problems) or None


def neighbours(key: str) -> Sequence[tuple[str, Any]]:
    return one_factor_away(KNOWN[key], KNOWN.values(), RIGHT, FACTORS, measure)


TABLES = (
    NamerTable(
        exercise="1.2",
        function="average_gradients",
        factors=tuple(f"{f} ({' / '.join(v)})" for f, v in FACTORS.items()),
        cases=CASES,
        mistakes=(
            KnownMistake("sum", "a factor: the group size", "2 ranks", "the sum: divide"),
            KnownMistake(
                "world size",
                "the world's size for the group's",
                "groups (0, 1), (2, 3) of 4",
                "divided by the world's size instead of the group's",
            ),
            KnownMistake(
                "twice",
                "a factor: the group size, the other way",
                "2 ranks",
                "divided by the number of ranks twice",
            ),
        ),
        right=lambda: measure({}),
        plant=lambda key: measure(KNOWN[key]),
        name=name,
        neighbours=neighbours,
    ),
)
