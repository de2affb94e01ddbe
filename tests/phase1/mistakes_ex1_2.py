"""1.2's namer and what it knows (issue 49): ``average_gradients``' realistic mistakes, each off
by the number it divides by, and the graded case that tells it from the others.

The grader gives rank r gradients all r+1 and reads back one value per rank: on 2 ranks, on 4,
and inside the groups (0, 1) and (2, 3) of a world of 4, where the same run also averages over
the whole world (a group of 2 in a world of 4 halves the mean both when it divides by the
world's size and when it divides by the group's twice; only the whole world tells them apart).
The mistakes are planted here by an averaging of our own with one switch per factor.

``data_parallel_step``'s loss check names a cause by the first step whose mean loss differs
(LOSS_ADVICE): a step's loss is computed before its update, so step 0 tells the start and the
loss apart from the updates, step 1 the first update, step 2 the leftovers of an earlier one.
What it judges is that step, not the values, so its table measures the step (and whether the
weights differ at the end) of a data-parallel run of our own, every rank in this process, with
one switch per factor; the causes one step cannot tell apart are one row, listed in its words.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).parent) not in sys.path:  # loaded by path: the grader's folder
    sys.path.insert(0, str(Path(__file__).parent))
from grade_1_2_averaging import (
    GLOBAL_BATCH,
    REDUCED,
    STEPS,
    check_mean,
    global_batches,
    loss_advice,
    make_toy,
    single_process_reference,
)
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


# ----------------------------------------------------------------------------- data_parallel_step

STEP_FACTORS: dict[str, tuple[str, ...]] = {
    "start": ("broadcast", "own weights"),
    "loss": ("mean", "divided by the world"),
    "grads": ("averaged", "local", "summed", "averaged after the step"),
    "zero": ("before backward", "never", "after backward"),
}
STEP_RIGHT = {factor: values[0] for factor, values in STEP_FACTORS.items()}
STEP_KNOWN = {
    "start or loss": {"start": "own weights"},
    "update": {"grads": "local"},
    "leftovers": {"zero": "never"},
}
WORLDS = (2, 3, 4)  # test_dp_step_equals_one_process_on_the_whole_batch's world sizes


def _run(world: int, way: dict[str, str]) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """A data-parallel run of ``world`` ranks written ``way``, every rank in this process: the
    mean of the ranks' losses per step and every rank's weights at the end."""
    models = [make_toy(5 if way["start"] == "broadcast" else 5 + r) for r in range(world)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    per_rank, means = GLOBAL_BATCH // world, []
    for inputs, targets in global_batches(STEPS, GLOBAL_BATCH):
        losses = []
        for r, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            if way["zero"] == "before backward":
                optimizer.zero_grad(set_to_none=True)
            shard = slice(r * per_rank, (r + 1) * per_rank)
            loss = torch.nn.functional.cross_entropy(model(inputs[shard]), targets[shard])
            if way["loss"] == "divided by the world":
                loss = loss / world
            loss.backward()
            if way["zero"] == "after backward":
                optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        if way["grads"] == "averaged after the step":
            for optimizer in optimizers:
                optimizer.step()
        if way["grads"] != "local":
            for ps in zip(*(m.parameters() for m in models), strict=True):
                if ps[0].grad is None:
                    continue
                total = sum(p.grad for p in ps if p.grad is not None)
                for p in ps:
                    assert p.grad is not None
                    p.grad.copy_(total if way["grads"] == "summed" else total / world)
        if way["grads"] != "averaged after the step":
            for optimizer in optimizers:
                optimizer.step()
        means.append(sum(losses) / world)
    return means, [{n: p.detach() for n, p in m.named_parameters()} for m in models]


@cache
def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return single_process_reference()


def step_measure(changes: dict[str, str]) -> dict[int, tuple[int | None, bool]]:
    """Per world size: the first step whose mean loss differs from one process's (None: none),
    and whether any rank's weights differ at the end, as the grader reads them."""
    return dict(_step_measure(tuple(sorted((STEP_RIGHT | changes).items()))))


@cache  # the three generic tests plant the same ways: each run once
def _step_measure(
    way: tuple[tuple[str, str], ...],
) -> tuple[tuple[int, tuple[int | None, bool]], ...]:
    ref_losses, ref_params = _reference()
    out = {}
    for world in WORLDS:
        means, params = _run(world, dict(way))
        first = next(
            (s for s, (m, r) in enumerate(zip(means, ref_losses, strict=True))
             if abs(m - r) > 1e-12 * abs(r)),
            None,
        )  # fmt: skip
        apart = any(
            not torch.allclose(p[n], ref, rtol=0, atol=1e-12)
            for p in params
            for n, ref in ref_params.items()
        )
        out[world] = (first, apart)
    return tuple(out.items())


def step_name(measured: dict[int, tuple[int | None, bool]]) -> str | None:
    """The grader's words per world size: the first differing step's advice, or the weights."""
    said = []
    for world, (first, apart) in measured.items():
        if first is not None:
            said.append(f"{world} ranks, step {first}: the mean loss differs{loss_advice(first)}")
        elif apart:
            said.append(f"{world} ranks: after {STEPS} steps the weights differ")
    return "\n".join(said) or None


def step_neighbours(key: str) -> Sequence[tuple[str, Any]]:
    return one_factor_away(
        STEP_KNOWN[key], STEP_KNOWN.values(), STEP_RIGHT, STEP_FACTORS, step_measure
    )


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
    NamerTable(
        exercise="1.2",
        function="data_parallel_step",
        factors=tuple(f"{f} ({' / '.join(v)})" for f, v in STEP_FACTORS.items()),
        cases=tuple(f"{w} ranks" for w in WORLDS),
        mistakes=(
            KnownMistake(
                "start or loss",
                "the start weights or the loss's scale (one row: step 0 is all the check reads)",
                "2 ranks",
                "the ranks did not start from the same weights, or a rank's loss is not its "
                "batch's mean",
            ),
            KnownMistake(
                "update",
                "the gradient the step applies (not the mean over the ranks)",
                "2 ranks",
                "is every gradient the mean over the ranks before optimizer.step()?",
            ),
            KnownMistake(
                "leftovers",
                "the previous step's gradients kept",
                "2 ranks",
                "gradients left over from the previous step",
            ),
        ),
        right=lambda: step_measure({}),
        plant=lambda key: step_measure(STEP_KNOWN[key]),
        name=step_name,
        neighbours=step_neighbours,
    ),
)
