"""1.1's namer and what it knows (issue 49): the sampler's realistic mistakes, each off by one
factor of the epoch's index list, and the graded case that tells it from the others.

The mistakes are planted here by a sampler of our own with one switch per factor, written apart
from the grader's ``_variant`` (so the table checks the namer, not the namer against itself);
the measurement is what the grader records, every graded case's (indices, len()).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).parent) not in sys.path:  # loaded by path: the grader's folder
    sys.path.insert(0, str(Path(__file__).parent))
from grade_1_1_sampler import Case, Yielded, graded_cases, sampler_verdict
from mistake_tables import KnownMistake, NamerTable, one_factor_away

# factor -> its values, the right one first
FACTORS: dict[str, tuple[str, ...]] = {
    "seeding": ("seed + epoch", "seed", "epoch"),
    "padding": ("repeat from the front", "from the end", "once", "none"),
    "sharding": ("interleaved", "blocks"),
    "count": ("drop_last rounds down", "rounds up"),
}
RIGHT = {factor: values[0] for factor, values in FACTORS.items()}
KNOWN = {
    "epoch ignored": {"seeding": "seed"},
    "pad from end": {"padding": "from the end"},
    "pad once": {"padding": "once"},
    "blocks": {"sharding": "blocks"},
    "drop_last rounds up": {"count": "rounds up"},
}


def shard(case: Case, setting: dict[str, str]) -> Yielded:
    """What a sampler with ``setting``'s choices yields for ``case``, and its len()."""
    n, world, rank, shuffle, seed, drop_last, epoch = case
    if drop_last and setting["count"] == "drop_last rounds down":
        per_rank = n // world
    else:
        per_rank = -(-n // world)
    total = per_rank * world
    if shuffle:
        g = torch.Generator()
        g.manual_seed(
            {"seed + epoch": seed + epoch, "seed": seed, "epoch": epoch}[setting["seeding"]]
        )
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    if drop_last:
        order = order[:total]
    elif total > n and n:
        missing = total - n
        repeated = order * math.ceil(missing / n)
        padding = setting["padding"]
        if padding == "repeat from the front":
            order = order + repeated[:missing]
        elif padding == "from the end":
            order = order + repeated[len(repeated) - missing :]
        elif padding == "once":
            order = order + order[:missing]
    sharding = setting["sharding"]
    if sharding == "blocks":
        mine = order[rank * per_rank : (rank + 1) * per_rank]
    else:
        mine = order[rank:total:world]
    return mine, per_rank


@cache
def _measure(setting: tuple[tuple[str, str], ...]) -> dict[Case, Yielded]:
    chosen = dict(setting)
    return {case: shard(case, chosen) for case in graded_cases()}


def measure(changes: dict[str, str]) -> dict[Case, Yielded]:
    return _measure(tuple(sorted((RIGHT | changes).items())))


def neighbours(key: str) -> Sequence[tuple[str, Any]]:
    """The settings one factor away from ``key``'s (other than the right one and the known
    mistakes), each with what the grader would measure."""
    return one_factor_away(KNOWN[key], KNOWN.values(), RIGHT, FACTORS, measure)


TABLES = (
    NamerTable(
        exercise="1.1",
        function="DistributedShardSampler",
        factors=tuple(f"{f} ({' / '.join(v)})" for f, v in FACTORS.items()),
        cases=("every n, num_replicas 1-4, rank, shuffle, drop_last, seed, epoch",),
        mistakes=tuple(
            KnownMistake(
                key,
                off_by=", ".join(f"{f}: {v}" for f, v in change.items()),
                separated_by="every n, num_replicas 1-4, rank, shuffle, drop_last, seed, epoch",
                says=says,
            )
            for (key, change), says in zip(
                KNOWN.items(),
                (
                    "the order ignores the epoch",
                    "padding repeats the end of the list",
                    "the padding repeats the list at most once",
                    "each rank takes a contiguous block",
                    "the count ignores drop_last",
                ),
                strict=True,
            )
        ),
        right=lambda: measure({}),
        plant=lambda key: measure(KNOWN[key]),
        name=sampler_verdict,
        neighbours=neighbours,
    ),
)
