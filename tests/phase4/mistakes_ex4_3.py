"""4.3's namer and what it knows (issue 49): ``ElasticSampler`` resuming, at a world of 3, the
position 16 that a world of 2 x 8 samples per step saved; the realistic mistakes, each off by
the order of skip and deal, by the count skipped, or by how the rest is dealt.

The shards are planted here by a sampler of our own with one switch per factor, on the epoch
order of the grader's case (96 samples, seed 5, epoch 1). The rest of 4.3's failures state what
a check counted and name no cause beyond it, so they have no table:

- plan_batches keep-global (accumulation, global batch, lr) describes, names no cause: it shows
  the three numbers and the samples per step they train against the 32 kept;
- plan_batches' refusal of 24 / (2 x 8) describes, names no cause: it shows the plan returned
  (or the refusal lacking a number) and the 1.5 accumulation steps that cannot be;
- plan_batches scale-lr describes, names no cause: it shows the plan and the expected 16 and 0.05;
- the changing-world sampler check describes, names no cause: the step's block against the next
  block of the epoch's order, and the samples seen twice;
- the resume at world 2 (progress, audit world sizes) describes, names no cause: the progress
  saved and the world sizes the audit saw against [1, 2];
- the torchrun join-and-leave checks (exit code, DONE line, resumes, audits) describe, name no
  cause: what the journal holds against what each step of the scenario should leave there.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).parent) not in sys.path:  # loaded by path: the grader's folder
    sys.path.insert(0, str(Path(__file__).parent))
from grade_4_3_elastic import (
    RESUME_BATCH,
    RESUME_POSITION,
    RESUME_WORLD,
    resume_verdict,
)
from mistake_tables import KnownMistake, NamerTable, one_factor_away

FACTORS: dict[str, tuple[str, ...]] = {
    "first": ("skip, then deal", "deal, then skip"),
    "skipped": ("position", "position // world (floor)", "ceil(position / world)"),
    "deal": ("interleaved", "contiguous blocks"),
}
RIGHT = {factor: values[0] for factor, values in FACTORS.items()}
KNOWN = {"deal first": {"first": "deal, then skip", "skipped": "position // world (floor)"}}
CASE = "world 3 resuming position 16"


def epoch_order() -> list[int]:
    g = torch.Generator().manual_seed(5 + 1)
    return torch.randperm(96, generator=g)[: 96 // RESUME_BATCH * RESUME_BATCH].tolist()


def shards(s: dict[str, str]) -> list[list[int]]:
    order, world, position = epoch_order(), RESUME_WORLD, RESUME_POSITION
    skip = {
        "position": position,
        "position // world (floor)": position // world,
        "ceil(position / world)": -(-position // world),
    }[s["skipped"]]

    def deal(items: list[int], rank: int) -> list[int]:
        if s["deal"] == "interleaved":
            return items[rank::world]
        per = -(-len(items) // world)
        return items[rank * per : (rank + 1) * per]

    if s["first"] == "skip, then deal":
        return [deal(order[skip:], r) for r in range(world)]
    return [deal(order, r)[skip:] for r in range(world)]


def measure(changes: dict[str, str]) -> list[list[int]]:
    return shards(RIGHT | changes)


def name(measured: list[list[int]]) -> str | None:
    return resume_verdict(measured, epoch_order())


def neighbours(key: str) -> Sequence[tuple[str, Any]]:
    return one_factor_away(KNOWN[key], KNOWN.values(), RIGHT, FACTORS, measure)


TABLES = (
    NamerTable(
        exercise="4.3",
        function="ElasticSampler.shard",
        factors=tuple(f"{f} ({' / '.join(v)})" for f, v in FACTORS.items()),
        cases=(CASE,),
        mistakes=(
            KnownMistake(
                "deal first",
                "the order of skip and deal (16 / 3 is not whole)",
                CASE,
                "the shards of a deal first",
            ),
        ),
        right=lambda: measure({}),
        plant=lambda key: measure(KNOWN[key]),
        name=name,
        neighbours=neighbours,
    ),
)
