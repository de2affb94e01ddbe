"""2.2's namers and the mistakes they know (tests/mistake_tables.py, issue 49).

* The loss scaler's update, judged by :func:`grade_2_2_mixed_precision.scale_verdict` on the
  grader's three streams (factors 2 and 0.25, exact in float32, then 1.3/0.7 and 1.001/0.9, which
  round). A realistic mistake is off in how the product is rounded (in float32, or not at all:
  a float64 scale) or in the state machine (the interval off by one, the count not restarted
  after an overflow, the factors swapped). Named: the two roundings, told apart by whether the
  scale is a float32 number; every state-machine mistake gets the same honest advice.
* ``unscale_``, judged by :func:`grade_2_2_mixed_precision.unscale_verdict` on 4096 gradients at
  a scale that is no power of two. Realistic ways: divide by the scale, divide or multiply in
  float64 and round each result, multiply by a float32 inverse computed in float32 (which, at
  this scale, is GradScaler's own number: it cannot show, and is not named).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:  # loaded by path (tests/mistake_tables.py)
    sys.path.insert(0, str(Path(__file__).parent))

import torch
from grade_2_2_mixed_precision import (
    UNSCALE_SCALE,
    scale_verdict,
    scaled_gradients,
    stream_cases,
    unscale_verdict,
)
from mistake_tables import KnownMistake, NamerTable

STREAMS = stream_cases()
STREAM_LABELS = tuple(label for label, *_ in STREAMS)


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def stream(
    kwargs: dict[str, Any],
    steps: int,
    overflows: set[int],
    rounding: str = "float64 product",
    interval_shift: int = 0,
    restart_after_overflow: bool = True,
    swapped: bool = False,
) -> list[float]:
    """The scales after each iteration of a scaler with these ways (GradScaler's by default:
    the float32 scale times the factor in float64, rounded once; grow after ``interval`` clean
    iterations in a row; restart the count after an overflow and after a growth)."""
    scale = f32(kwargs["init_scale"])
    growth, backoff = kwargs["growth_factor"], kwargs["backoff_factor"]
    if swapped:
        growth, backoff = backoff, growth
    interval = kwargs["growth_interval"] + interval_shift

    def times(x: float, factor: float) -> float:
        if rounding == "float64 product":
            return f32(x * factor)
        if rounding == "float32 product":
            return float(
                torch.tensor(x, dtype=torch.float32) * torch.tensor(factor, dtype=torch.float32)
            )
        return x * factor  # a float64 scale, never rounded

    tracker, scales = 0, []
    for step in range(steps):
        if step in overflows:
            scale = times(scale, backoff)
            tracker = 0 if restart_after_overflow else tracker
        else:
            tracker += 1
            if tracker >= interval:
                scale, tracker = times(scale, growth), 0
        scales.append(scale)
    return scales


STREAM_WAYS: dict[str, dict[str, Any]] = {
    "right": {},
    "float32 product": {"rounding": "float32 product"},
    "float64 scale": {"rounding": "float64 scale"},
    "interval + 1": {"interval_shift": 1},
    "interval - 1": {"interval_shift": -1},
    "count not restarted after an overflow": {"restart_after_overflow": False},
    "factors swapped": {"swapped": True},
    "float32 product, interval + 1": {"rounding": "float32 product", "interval_shift": 1},
    "float64 scale, count not restarted": {"rounding": "float64 scale",
                                           "restart_after_overflow": False},
}  # fmt: skip


def streams(way: str) -> dict[str, list[float]]:
    return {
        label: stream(kwargs, steps, overflows, **STREAM_WAYS[way])
        for label, kwargs, steps, overflows in STREAMS
    }


def stream_name(measured: dict[str, list[float]]) -> str | None:
    """The first verdict, stream by stream in the grader's order, against GradScaler's scales
    (simulated here; the right simulation is checked against GradScaler by the table's test)."""
    right = streams("right")
    for label, _, _, overflows in STREAMS:
        said = scale_verdict(label, measured[label], right[label], overflows)
        if said:
            return said
    return None


UNSCALE_CASE = f"4096 gradients at scale {UNSCALE_SCALE:.6g}"
WAYS = {
    "GradScaler's": lambda g: g * torch.tensor(1 / UNSCALE_SCALE, dtype=torch.float64).float(),
    "divided": lambda g: g / torch.tensor(UNSCALE_SCALE, dtype=torch.float32),
    "divided in float64": lambda g: (g.double() / UNSCALE_SCALE).float(),
    "multiplied in float64": lambda g: (g.double() * (1 / UNSCALE_SCALE)).float(),
    "float32 inverse": lambda g: g * (1 / torch.tensor(UNSCALE_SCALE, dtype=torch.float32)),
}


def unscaled(way: str) -> dict[str, torch.Tensor]:
    return {UNSCALE_CASE: WAYS[way](scaled_gradients())}


def unscale_name(measured: dict[str, torch.Tensor]) -> str | None:
    theirs = unscaled("GradScaler's")[UNSCALE_CASE]
    return unscale_verdict(measured[UNSCALE_CASE], theirs, scaled_gradients(), UNSCALE_SCALE)


TABLES = (
    NamerTable(
        exercise="2.2",
        function="DynamicLossScaler.update",
        factors=("how the product is rounded", "the growth interval", "the count's restart",
                 "which factor goes with which event"),
        cases=STREAM_LABELS,
        mistakes=(
            KnownMistake("float32_product", "the float64 product", STREAM_LABELS[1],
                         "a float32 number rounded otherwise"),
            KnownMistake("float64_scale", "the rounding to float32", STREAM_LABELS[1],
                         "no float32 number"),
        ),
        right=lambda: streams("right"),
        plant=lambda key: streams({"float32_product": "float32 product",
                                   "float64_scale": "float64 scale"}[key]),
        name=stream_name,
        neighbours=lambda key: [(way, streams(way)) for way in STREAM_WAYS],
    ),
    NamerTable(
        exercise="2.2",
        function="DynamicLossScaler.unscale_",
        factors=("multiply or divide", "in float32 or float64", "where the inverse is rounded"),
        cases=(UNSCALE_CASE,),
        mistakes=(
            KnownMistake("divided", "dividing for multiplying", UNSCALE_CASE,
                         "it divides by the scale"),
            # no case tells these two apart: a float64 quotient and a float64 product by a
            # float64 inverse round to the same float32 (merged, the namer lists both)
            KnownMistake("float64_then_rounded", "float64 arithmetic, rounded per gradient",
                         UNSCALE_CASE, "this fits each of: it divides in float64 and rounds each "
                         "quotient; it multiplies by 1/scale in float64"),
        ),
        right=lambda: unscaled("GradScaler's"),
        plant=lambda key: unscaled({"divided": "divided",
                                    "float64_then_rounded": "divided in float64"}[key]),
        name=unscale_name,
        neighbours=lambda key: [(way, unscaled(way)) for way in WAYS],
    ),
)  # fmt: skip


def grad_scaler_streams() -> dict[str, list[float]]:
    """GradScaler's own scales on the graded streams (for the check that the simulation of the
    right scaler is GradScaler)."""
    from grade_2_2_mixed_precision import run_scaler_stream

    return {
        label: run_scaler_stream(torch.amp.GradScaler("cpu", **kwargs), steps, overflows)[0]
        for label, kwargs, steps, overflows in STREAMS
    }
