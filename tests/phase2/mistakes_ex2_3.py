"""2.3's namers and the mistakes they know (tests/mistake_tables.py, issue 49).

``checkpoint_sequential``'s forward calls per layer are judged by
:func:`grade_2_3_checkpointing.forward_count_verdict` at 2, 3, 4 and 6 segments of 18 layers. A
realistic mistake is off in one of three factors: whether the last segment is checkpointed too,
how often a checkpointed segment runs (twice; once when backward never recomputes; three times),
and where the segments are cut (torch's: 18 // segments layers, the last taking the rest; or
ceil(18 / segments); or one layer more). At 4 segments, which do not divide 18, every cut
differs. Named: only the checkpointed last segment, when every segment ran exactly twice.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from itertools import product
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:  # loaded by path (tests/mistake_tables.py)
    sys.path.insert(0, str(Path(__file__).parent))

from grade_2_3_checkpointing import FORWARD_COUNT_SEGMENTS, forward_count_verdict
from mistake_tables import KnownMistake, NamerTable

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

TABLES = (
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
