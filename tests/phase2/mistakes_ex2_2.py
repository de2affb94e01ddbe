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

Also below (each with its comment block): the loss under autocast
(:func:`autocast_loss_verdict`), the clipping (:func:`clipping_verdict`, :func:`clipping_advice`)
and the overflow flag across ranks (:func:`skip_verdict`). Messages that describe and name no
cause, so need no table:

* skip_verdict's scale after iteration 1 and its steps over 4 iterations describe, name no cause.
* clipping_advice for a step much smaller (not by the scale) or larger describes, names no cause.
* the overflow flag's crossing of the scaler's group (fail_on_crossing) describes, names no cause.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:  # loaded by path (tests/mistake_tables.py)
    sys.path.insert(0, str(Path(__file__).parent))

import torch
from grade_2_2_mixed_precision import (
    CLIP_SCALE,
    UNSCALE_SCALE,
    autocast_loss_verdict,
    autocast_losses,
    batch,
    clipping_verdict,
    scale_verdict,
    scaled_gradients,
    skip_verdict,
    small_mlp,
    stream_cases,
    unscale_verdict,
)
from mistake_tables import KnownMistake, NamerTable, one_factor_away

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


TABLES: tuple[NamerTable, ...] = (
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


# ---------------------------------------------------------------------------- the autocast loss
# mixed_precision_step's returned loss under bf16 autocast, judged by autocast_loss_verdict on
# the grader's batch of 16. Factors: where the cross-entropy runs (inside autocast, or after it
# on the bf16 logits) and how the value comes back (as computed, rounded to bf16, halved). The loss
# computed outside autocast and the float32 loss rounded to bf16 give the same number here (a
# bf16 loss): one row, whose message lists both; told only when the value is exactly that loss.

AUTOCAST_CASES = ("mixed_precision_step(autocast_dtype=torch.bfloat16), batch of 16",)
LOSS_RIGHT = {"where": "inside autocast", "returned": "as computed"}
LOSS_FACTORS = {
    "where": ("inside autocast", "outside, on the bf16 logits"),
    "returned": ("as computed", "rounded to bf16", "halved"),
}
LOSS_PLANTED = {"loss_in_bf16": {"where": "outside, on the bf16 logits"}}


def autocast_loss(setting: dict[str, str]) -> tuple[float, float, float]:
    """(the returned loss, the reference, the loss outside autocast), the first from the
    factors: the cross-entropy written here where the factor puts it."""
    x, y = batch(16)
    model = small_mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
        inside = torch.nn.functional.cross_entropy(logits, y)
    outside = torch.nn.functional.cross_entropy(logits, y)
    loss = inside if setting["where"] == "inside autocast" else outside
    value = {"as computed": loss.item(), "rounded to bf16": loss.to(torch.bfloat16).item(),
             "halved": loss.item() / 2}[setting["returned"]]  # fmt: skip
    return value, *autocast_losses(small_mlp(), x, y)


TABLES = (
    *TABLES,
    NamerTable(
        exercise="2.2",
        function="mixed_precision_step (its loss under autocast)",
        factors=tuple(LOSS_FACTORS),
        cases=AUTOCAST_CASES,
        mistakes=(
            KnownMistake("loss_in_bf16", "float32 for bf16 in the loss", AUTOCAST_CASES[0],
                         "Yours is exactly the loss in bf16"),
        ),
        right=lambda: autocast_loss(LOSS_RIGHT),
        plant=lambda key: autocast_loss({**LOSS_RIGHT, **LOSS_PLANTED[key]}),
        name=lambda measured: autocast_loss_verdict(*measured),
        neighbours=lambda key: one_factor_away(
            LOSS_PLANTED[key], LOSS_PLANTED.values(), LOSS_RIGHT, LOSS_FACTORS,
            lambda changed: autocast_loss({**LOSS_RIGHT, **changed}),
        ),
    ),
)  # fmt: skip


# ---------------------------------------------------------------------------- the clipping
# mixed_precision_step with clipping, judged by clipping_verdict over 3 iterations at scale 2^12
# and max_norm 0.05 (the loss of each iteration, with what the earlier steps' update sizes say,
# then the weights). Factors: where the clipping runs (between the unscaling and the step,
# before the unscaling, after the step, nowhere), its max_norm (0.05, 0.1, 1.0) and how often
# the gradients are unscaled (once, twice). Each setting is run here with GradScaler and
# clip_grad_norm_ written in that order, in process. Named: the clipping of the still-scaled
# gradients (a step exactly the scale times smaller); everything else is described by its ratio.

CLIP_CASES = ("mixed_precision_step, init scale 2^12, clipping at 0.05, 3 iterations",)
CLIP_RIGHT = {"clip": "between unscale and step", "max_norm": "0.05", "unscale": "once"}
CLIP_FACTORS = {
    "clip": ("between unscale and step", "before unscale", "after step", "nowhere"),
    "max_norm": ("0.05", "0.1", "1.0"),
    "unscale": ("once", "twice"),
}
CLIP_PLANTED = {"clip_scaled": {"clip": "before unscale"}}
ClipRun = tuple[list[float], list[float], list[tuple[float, float]], tuple[str, float]]


def _clip_steps(setting: dict[str, str]) -> tuple[list[float], list[float], torch.nn.Module]:
    """The losses and update norms of 3 iterations with these factors, and the model after."""
    x, y = batch(16)
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=CLIP_SCALE)
    norm = float(setting["max_norm"])
    losses, moves = [], []
    for _ in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if setting["clip"] == "before unscale":
            torch.nn.utils.clip_grad_norm_(model.parameters(), norm)
        scaler.unscale_(optimizer)
        if setting["unscale"] == "twice":
            for p in model.parameters():
                assert p.grad is not None
                p.grad /= scaler.get_scale()
        if setting["clip"] == "between unscale and step":
            torch.nn.utils.clip_grad_norm_(model.parameters(), norm)
        scaler.step(optimizer)
        scaler.update()
        if setting["clip"] == "after step":
            torch.nn.utils.clip_grad_norm_(model.parameters(), norm)
        losses.append(loss.item())
        moves.append(sum(float(((p.detach() - b) ** 2).sum())
                         for b, p in zip(before, model.parameters(), strict=True)) ** 0.5)  # fmt: skip
    return losses, moves, model


def clip_run(setting: dict[str, str]) -> ClipRun:
    losses, moves, model = _clip_steps(setting)
    ref_losses, ref_moves, ref_model = _clip_steps(CLIP_RIGHT)
    worst = max(((n, (p - q).abs().max().item()) for (n, p), q in
                 zip(model.named_parameters(), ref_model.parameters(), strict=True)),
                key=lambda named: named[1])  # fmt: skip
    return losses, ref_losses, list(zip(moves, ref_moves, strict=True)), worst


TABLES = (
    *TABLES,
    NamerTable(
        exercise="2.2",
        function="mixed_precision_step (its clipping)",
        factors=tuple(CLIP_FACTORS),
        cases=CLIP_CASES,
        mistakes=(
            KnownMistake("clip_scaled", "a factor of the scale", CLIP_CASES[0],
                         "the clipping saw gradients still multiplied by the scale"),
        ),
        right=lambda: clip_run(CLIP_RIGHT),
        plant=lambda key: clip_run({**CLIP_RIGHT, **CLIP_PLANTED[key]}),
        name=lambda measured: clipping_verdict(*measured),
        neighbours=lambda key: one_factor_away(
            CLIP_PLANTED[key], CLIP_PLANTED.values(), CLIP_RIGHT, CLIP_FACTORS,
            lambda changed: clip_run({**CLIP_RIGHT, **changed}),
        ),
    ),
)  # fmt: skip


# ---------------------------------------------------------------------------- the overflow flag
# DynamicLossScaler on 2 ranks and on two groups of 2 of 4 ranks (rank 1, of the first group,
# overflows at iteration 1 of 4; init scale 256, growth interval 2), judged by skip_verdict.
# Factors: how the overflow flag is reduced (MAX on the scaler's group, not at all, MIN on the
# group, MAX on the world) and what a skipped step does (changes nothing, or still changes the
# optimizer state). Histories are written here from GradScaler's rules (skip and halve on an
# overflow; double after 2 clean iterations in a row). Named: the flag not shared (rank 1
# skipped alone) and the flag reduced over the world (the other group skipped iteration 1 only);
# listed: no rank seeing the overflow (MIN).

SKIP_CASES = ("DynamicLossScaler on 2 ranks", "DynamicLossScaler(group=...) on two groups of 2")
SKIP_RIGHT = {"reduce": "MAX on the group", "skipped step": "changes nothing"}
SKIP_FACTORS = {
    "reduce": ("MAX on the group", "none", "MIN on the group", "MAX on the world"),
    "skipped step": ("changes nothing", "changes the state"),
}
SKIP_PLANTED = {
    "flag_not_shared": {"reduce": "none"},
    "flag_over_the_world": {"reduce": "MAX on the world"},
    "min_flag": {"reduce": "MIN on the group"},
}
Ranks = list[dict[str, Any]]


def scaler_ranks(world: int, setting: dict[str, str]) -> Ranks:
    """Every rank's (stepped, unchanged, scale) over 4 iterations, groups of 2 when world = 4."""
    size = 2
    found = []
    for rank in range(world):
        index = rank // size
        group = range(index * size, index * size + size)
        scale, clean, history = 256.0, 0, []
        for step in range(4):
            flags = {r: int(step == 1 and r == 1) for r in range(world)}
            reduce = setting["reduce"]
            seen = {"none": flags[rank], "MAX on the group": max(flags[r] for r in group),
                    "MIN on the group": min(flags[r] for r in group),
                    "MAX on the world": max(flags.values())}[reduce]  # fmt: skip
            if seen:
                scale, clean = scale * 0.5, 0
                history.append((False, setting["skipped step"] == "changes nothing", scale))
            else:
                clean += 1
                if clean == 2:
                    scale, clean = scale * 2.0, 0
                history.append((True, False, scale))
        found.append({"history": history, "index": index})
    return found


def skip_runs(setting: dict[str, str]) -> dict[str, Ranks]:
    return {SKIP_CASES[0]: scaler_ranks(2, setting), SKIP_CASES[1]: scaler_ranks(4, setting)}


def skip_name(measured: dict[str, Ranks]) -> str | None:
    return next((s for label in SKIP_CASES if (s := skip_verdict(measured[label], label))), None)


TABLES = (
    *TABLES,
    NamerTable(
        exercise="2.2",
        function="DynamicLossScaler.unscale_ (the overflow flag)",
        factors=tuple(SKIP_FACTORS),
        cases=SKIP_CASES,
        mistakes=(
            KnownMistake("flag_not_shared", "the group", SKIP_CASES[0],
                         "rank 1's overflow did not reach"),
            KnownMistake("flag_over_the_world", "the world for the group", SKIP_CASES[1],
                         "the flag was reduced over the world"),
            KnownMistake("min_flag", "MIN for MAX", SKIP_CASES[0], "no rank saw the overflow"),
        ),
        right=lambda: skip_runs(SKIP_RIGHT),
        plant=lambda key: skip_runs({**SKIP_RIGHT, **SKIP_PLANTED[key]}),
        name=skip_name,
        neighbours=lambda key: one_factor_away(
            SKIP_PLANTED[key], SKIP_PLANTED.values(), SKIP_RIGHT, SKIP_FACTORS,
            lambda changed: skip_runs({**SKIP_RIGHT, **changed}),
        ),
    ),
)  # fmt: skip
