"""2.5's namers and the mistakes they know (tests/mistake_tables.py, issue 49).

The executor's loss on the last stage is judged by :func:`grade_2_5_pipeline.loss_verdict`, case
by case in the grader's order (p = 2, then p = 4; per schedule m = 1, 2p + 1, p). A realistic
mistake divides the summed micro-batch losses by the wrong count: by nothing, by the rank count
p, by the stage count (p x v for interleaved), by m x p or by m twice. The one named cause, the
unscaled sum (m times the mean), is first seen at m = 2p + 1, a count unlike p and every stage
count; a loss off by p fails first at m = 1, where no cause fits, and is described by its ratio.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:  # loaded by path (tests/mistake_tables.py)
    sys.path.insert(0, str(Path(__file__).parent))

from grade_2_5_pipeline import case_label, executor_cases, loss_verdict
from mistake_tables import KnownMistake, NamerTable

V = 2  # chunks per rank of the graded interleaved cases


def graded() -> list[tuple[str, int, int, int]]:
    """(label, p, m, stages) of every case whose loss the grader judges, in its order."""
    found = []
    for p in (2, 4):
        for case in executor_cases(p):
            name, m = case[0], case[1]
            if name == "interleaved" and m % p:
                continue  # refused, not run
            found.append((case_label(p, case), p, m, p * V if name == "interleaved" else p))
    return found


CASES = tuple(label for label, *_ in graded())
# the count the summed micro-batch losses are divided by, from (p, m, stages)
DIVISORS: dict[str, Callable[[int, int, int], int]] = {
    "m": lambda p, m, s: m,
    "1": lambda p, m, s: 1,
    "p": lambda p, m, s: p,
    "stages": lambda p, m, s: s,
    "m x p": lambda p, m, s: m * p,
    "m x m": lambda p, m, s: m * m,
}
PLANTED = {"unscaled_sum": "1"}


def measure(divisor: str) -> dict[str, float]:
    """The last stage's loss over the single-device mean, per case: m means summed, over the
    divisor."""
    return {label: m / DIVISORS[divisor](p, m, s) for label, p, m, s in graded()}


def name(measured: dict[str, float]) -> str | None:
    """The grader's first verdict, case by case (the loss over a mean of 1)."""
    for label, _, m, _ in graded():
        said = loss_verdict(label, 0, measured[label], 1.0, m)
        if said:
            return said
    return None


TABLES = (
    NamerTable(
        exercise="2.5",
        function="PipelineExecutor (the loss of a step)",
        factors=tuple(f"the divisor {d}" for d in DIVISORS),
        cases=CASES,
        mistakes=(KnownMistake("unscaled_sum", "a factor m", CASES[1], "it is m = "),),
        right=lambda: measure("m"),
        plant=lambda key: measure(PLANTED[key]),
        name=name,
        neighbours=lambda key: [(f"divided by {d}", measure(d)) for d in DIVISORS],
    ),
)
