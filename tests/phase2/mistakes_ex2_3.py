"""2.3's namers and the mistakes they know (tests/mistake_tables.py, issue 49).

``checkpoint_sequential``'s forward calls per layer are judged by
:func:`grade_2_3_checkpointing.forward_count_verdict` at 2, 3, 4 and 6 segments of 18 layers. A
realistic mistake is off in one of three factors: whether the last segment is checkpointed too,
how often a checkpointed segment runs (twice; once when backward never recomputes; three times),
and where the segments are cut (torch's: 18 // segments layers, the last taking the rest; or
ceil(18 / segments); or one layer more). At 4 segments, which do not divide 18, every cut
differs. Named: only the checkpointed last segment, when every segment ran exactly twice.

Also below: the parameters left without a gradient (:func:`missing_gradients_verdict`) and
gradients that differ while the output matched (:func:`why_gradients_differ`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from itertools import product
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:  # loaded by path (tests/mistake_tables.py)
    sys.path.insert(0, str(Path(__file__).parent))

from grade_2_3_checkpointing import (
    FORWARD_COUNT_SEGMENTS,
    GRADIENT_SEGMENTS,
    forward_count_verdict,
    missing_gradients_verdict,
    why_gradients_differ,
)
from mistake_tables import KnownMistake, NamerTable, one_factor_away

LAYERS = 18  # deep_dropout_mlp(): 6 x (Linear, ReLU, Dropout)
CASES = tuple(f"{s} segments" for s in FORWARD_COUNT_SEGMENTS)
CUTS: dict[str, Callable[[int, int], int]] = {
    "torch's": lambda n, s: n // s,
    "ceil": lambda n, s: math.ceil(n / s),
    "one more": lambda n, s: n // s + 1,
}


def calls(cut: str, last_checkpointed: bool, runs: int) -> dict[str, dict[int, int]]:
    """Forward calls per layer, per graded segment count, of a checkpoint_sequential that cuts
    ``cut``-long segments (the last taking the rest), runs a checkpointed one ``runs`` times,
    and checkpoints the last one too or not (written here from the factors, not from the grader's
    bounds)."""
    found = {}
    for segments, label in zip(FORWARD_COUNT_SEGMENTS, CASES, strict=True):
        size = CUTS[cut](LAYERS, segments)
        starts = [k * size for k in range(segments) if k * size < LAYERS]
        counted: dict[int, int] = {}
        for index, start in enumerate(starts):
            is_last = index == len(starts) - 1
            end = LAYERS if is_last else min(start + size, LAYERS)
            for layer in range(start, end):
                counted[layer] = runs if (not is_last or last_checkpointed) else 1
        found[label] = counted
    return found


def name(measured: dict[str, dict[int, int]]) -> str | None:
    """The first verdict, in the grader's order of segment counts."""
    for segments, label in zip(FORWARD_COUNT_SEGMENTS, CASES, strict=True):
        said = forward_count_verdict(segments, measured[label], LAYERS)
        if said:
            return said
    return None


PLANTED = {
    "last_checkpointed": ("torch's", True, 2),
    "never_recomputed": ("torch's", False, 1),
    "ceil_cut": ("ceil", False, 2),
}

TABLES: tuple[NamerTable, ...] = (
    NamerTable(
        exercise="2.3",
        function="checkpoint_sequential (forward calls per layer)",
        factors=("the last segment checkpointed or not", "runs of a checkpointed segment",
                 "where the segments are cut"),
        cases=CASES,
        mistakes=(
            KnownMistake("last_checkpointed", "one forward of the last segment", CASES[0],
                         "checkpointing it only adds a forward"),
            KnownMistake("never_recomputed", "the recomputation", CASES[0],
                         "Backward never ran them again"),
            KnownMistake("ceil_cut", "ceil for floor in the segment size", "4 segments",
                         "cuts 4 layers per segment"),
        ),
        right=lambda: calls("torch's", False, 2),
        plant=lambda key: calls(*PLANTED[key]),
        name=name,
        neighbours=lambda key: [
            (f"cut {c}, last {'checkpointed' if last else 'plain'}, runs {r}", calls(c, last, r))
            for c, last, r in product(CUTS, (False, True), (1, 2, 3))
        ],
    ),
)  # fmt: skip


# ---------------------------------------------------------------------------- the gradients
# Parameters with no (or an all-zero) gradient are judged by missing_gradients_verdict at 2, 3, 7
# and 18 segments. Factors: whether each recomputed segment's backward returns its input's
# gradient, whether a checkpointed segment's own parameters get theirs, whether the last (plain)
# segment's do. Named: the input's gradient not returned (every segment before the last
# checkpointed one); listed: the checkpointed segments' own parameters (no graph, or
# autograd.grad for autograd.backward: the same parameters miss out).

GRADIENT_CASES = tuple(f"{s} segments, bitwise gradients" for s in GRADIENT_SEGMENTS)
LINEARS = range(0, LAYERS, 3)  # deep_dropout_mlp: a Linear at every third layer
GRADIENT_RIGHT = {"input grad": "returned", "own params": "get theirs", "last segment": "gets"}
GRADIENT_FACTORS = {
    "input grad": ("returned", "not returned"),
    "own params": ("get theirs", "get none"),
    "last segment": ("gets", "gets none"),
}
GRADIENT_PLANTED = {
    "input_grad_not_returned": {"input grad": "not returned"},
    "own_params_get_none": {"own params": "get none"},
}


def missing(setting: dict[str, str]) -> dict[str, list[str]]:
    """The parameters with no gradient, per graded segment count (torch's cut written here)."""
    found = {}
    for segments, label in zip(GRADIENT_SEGMENTS, GRADIENT_CASES, strict=True):
        size = LAYERS // segments
        names = []
        for layer in LINEARS:
            s = min(layer // size, segments - 1)
            if s == segments - 1:
                gone = setting["last segment"] == "gets none"
            else:
                gone = setting["own params"] == "get none" or (
                    setting["input grad"] == "not returned" and s < segments - 2
                )
            if gone:
                names += [f"{layer}.weight", f"{layer}.bias"]
        found[label] = names
    return found


def missing_name(measured: dict[str, list[str]]) -> str | None:
    for segments, label in zip(GRADIENT_SEGMENTS, GRADIENT_CASES, strict=True):
        said = missing_gradients_verdict(segments, measured[label], LAYERS)
        if said:
            return said
    return None


# why_gradients_differ, when the output matched and a gradient did not: whether they match with
# dropout off. Factors: the RNG state restored before recomputing, the backward right.
WHY_RIGHT = {"rng": "restored", "backward": "right"}
WHY_FACTORS = {"rng": ("restored", "not restored"), "backward": ("right", "wrong")}
WHY_PLANTED = {"rng_not_restored": {"rng": "not restored"}, "backward_wrong": {"backward": "wrong"}}


def equal_gradients(setting: dict[str, str]) -> dict[str, tuple[bool, bool]]:
    """Per graded case: (equal with dropout, equal with dropout off)."""
    right = setting["backward"] == "right"
    return dict.fromkeys(GRADIENT_CASES, (right and setting["rng"] == "restored", right))


def why_name(measured: dict[str, tuple[bool, bool]]) -> str | None:
    for with_dropout, without in measured.values():
        if not with_dropout:
            return why_gradients_differ(without)
    return None


TABLES = (
    *TABLES,
    NamerTable(
        exercise="2.3",
        function="checkpoint / checkpoint_sequential (parameters left without a gradient)",
        factors=tuple(GRADIENT_FACTORS),
        cases=GRADIENT_CASES,
        mistakes=(
            KnownMistake("input_grad_not_returned", "the input's gradient", GRADIENT_CASES[1],
                         "did not flow from a recomputed segment back to its input"),
            KnownMistake("own_params_get_none", "the segment's own parameters", GRADIENT_CASES[0],
                         "every checkpointed segment, and no other"),
        ),
        right=lambda: missing(GRADIENT_RIGHT),
        plant=lambda key: missing({**GRADIENT_RIGHT, **GRADIENT_PLANTED[key]}),
        name=missing_name,
        neighbours=lambda key: one_factor_away(
            GRADIENT_PLANTED[key], GRADIENT_PLANTED.values(), GRADIENT_RIGHT, GRADIENT_FACTORS,
            lambda changed: missing({**GRADIENT_RIGHT, **changed}),
        ),
    ),
    NamerTable(
        exercise="2.3",
        function="checkpoint (gradients that differ while the output matched)",
        factors=tuple(WHY_FACTORS),
        cases=GRADIENT_CASES,
        mistakes=(
            KnownMistake("rng_not_restored", "the dropout masks", GRADIENT_CASES[0],
                         "with dropout off the gradients match too"),
            KnownMistake("backward_wrong", "the backward", GRADIENT_CASES[0],
                         "differ even with dropout off"),
        ),
        right=lambda: equal_gradients(WHY_RIGHT),
        plant=lambda key: equal_gradients({**WHY_RIGHT, **WHY_PLANTED[key]}),
        name=why_name,
        neighbours=lambda key: one_factor_away(
            WHY_PLANTED[key], WHY_PLANTED.values(), WHY_RIGHT, WHY_FACTORS,
            lambda changed: equal_gradients({**WHY_RIGHT, **changed}),
        ),
    ),
)  # fmt: skip
