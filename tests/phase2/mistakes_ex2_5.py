"""2.5's namers and the mistakes they know (tests/mistake_tables.py, issue 49).

The executor's loss on the last stage is judged by :func:`grade_2_5_pipeline.loss_verdict`, case
by case in the grader's order (p = 2, then p = 4; per schedule m = 1, 2p + 1, p). A realistic
mistake divides the summed micro-batch losses by the wrong count: by nothing, by the rank count
p, by the stage count (p x v for interleaved), by m x p or by m twice. The one named cause, the
unscaled sum (m times the mean), is first seen at m = 2p + 1, a count unlike p and every stage
count; a loss off by p fails first at m = 1, where no cause fits, and is described by its ratio.

Also below: a stage's parameter gradients (:func:`grade_2_5_pipeline.gradient_hint`: all zeros,
with the causes that fit listed, by whether the last stage's are right). Messages that describe and name no cause, so need no table:

* gradient_hint's norm ratio ("its norm is x times the expected one") describes, names no cause.
* the zero-bubble deferral hint (``no_deferral_hint``: every W right after its own B, which is
  1F1B's order with its backward cut in two) describes, names no cause.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:  # loaded by path (tests/mistake_tables.py)
    sys.path.insert(0, str(Path(__file__).parent))

import torch
from grade_2_5_pipeline import case_label, executor_cases, gradient_hint, loss_verdict
from mistake_tables import KnownMistake, NamerTable, one_factor_away

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


TABLES: tuple[NamerTable, ...] = (
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


# ---------------------------------------------------------------------------- a stage's gradients
# A parameter gradient that differs from the single-device model's gets gradient_hint, on the
# first stage (lowest) whose gradients differ: all zeros is the one case it reads a cause from,
# and even then it lists the causes that fit, told apart by whether the last stage's gradients
# are right (a later stage's input without requires_grad_(), or a backward not started from what
# came back) or zero too (a loss scaled by 0, or no backward); any other difference is described
# by its norm's ratio, which names no cause (a ratio of m, p or 2 comes from many mistakes).
# Factors: the scale the stage's gradient is off by, and the last stage's gradients (right, or
# zero). Measured: (got, expected, the last stage right) of the first gradient that differs.

SCALES = ("1", "0", "-1", "0.5", "2", "3")  # 3: m = 2p - 1 at p = 2
GRAD_RIGHT = {"scale": "1", "last stage": "right"}
GRAD_FACTORS = {"scale": SCALES, "last stage": ("right", "zero")}
GRAD_PLANTED = {
    "no_gradient_back": {"scale": "0"},
    "zero_loss": {"scale": "0", "last stage": "zero"},
}
Seen = dict[str, tuple[torch.Tensor, torch.Tensor, bool]]


def gradients(setting: dict[str, str]) -> Seen:
    """Per graded case, the first gradient the grader finds wrong (this stage's, or the last
    stage's when only that one is), the expected one and whether the last stage is right."""
    found = {}
    last_right = setting["last stage"] == "right"
    scale = 0.0 if not last_right and setting["scale"] == "1" else float(setting["scale"])
    for index, label in enumerate(CASES):
        expected = torch.randn(3, 4, generator=torch.Generator().manual_seed(index),
                               dtype=torch.float64)  # fmt: skip
        found[label] = (expected * scale, expected, last_right)
    return found


def gradient_name(measured: Seen) -> str | None:
    for got, expected, last_right in measured.values():
        if not (last_right and torch.allclose(got, expected, rtol=1e-10, atol=1e-12)):
            return gradient_hint(got, expected, last_right)
    return None


TABLES = (
    *TABLES,
    NamerTable(
        exercise="2.5",
        function="PipelineExecutor (a stage's parameter gradients)",
        factors=tuple(GRAD_FACTORS),
        cases=CASES,
        mistakes=(
            KnownMistake("no_gradient_back", "a factor 0 before the last stage", CASES[0],
                         "a later stage ran on its received activation without requires_grad_()"),
            KnownMistake("zero_loss", "a factor 0 everywhere", CASES[0],
                         "the loss was scaled by 0"),
        ),
        right=lambda: gradients(GRAD_RIGHT),
        plant=lambda key: gradients({**GRAD_RIGHT, **GRAD_PLANTED[key]}),
        name=gradient_name,
        neighbours=lambda key: one_factor_away(
            GRAD_PLANTED[key], GRAD_PLANTED.values(), GRAD_RIGHT, GRAD_FACTORS,
            lambda changed: gradients({**GRAD_RIGHT, **changed}),
        ),
    ),
)  # fmt: skip
