"""Where each pipeline stage lives: the one stage-to-rank rule, used by everything in 2.5.

A pipeline of p ranks, each holding v model chunks, has p·v *virtual stages* (the pieces of the
model, in order). As in Megatron-LM, they are dealt round-robin, chunk-major: rank r's chunk c is
virtual stage ``c·p + r``, so stage s lives on rank ``s mod p`` as its chunk ``s // p``::

    p = 2, v = 2:   stage 0 -> rank 0 chunk 0,  stage 1 -> rank 1 chunk 0,
                    stage 2 -> rank 0 chunk 1,  stage 3 -> rank 1 chunk 1

With v = 1 (GPipe, 1F1B) stage s is simply rank s. Ranks are ranks *within* the pipeline's
process group (the default group unless one is given); the executor maps them to global ranks
for its messages. Schedules, the simulator, the executor, the demo, the tests and the notebook
all place stages with these functions, so the rule is written once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def virtual_stage(rank: int, chunk: int, num_ranks: int) -> int:
    """The position in the whole model of ``rank``'s ``chunk``: chunk-major, as in Megatron-LM."""
    return chunk * num_ranks + rank


def stage_rank(stage: int, num_ranks: int) -> int:
    """The rank (within the pipeline group) that holds virtual stage ``stage``."""
    return stage % num_ranks


def stage_chunk(stage: int, num_ranks: int) -> int:
    """Which of its chunks virtual stage ``stage`` is on the rank that holds it."""
    return stage // num_ranks


def rank_stages(rank: int, num_ranks: int, num_chunks: int) -> list[int]:
    """The virtual stages ``rank`` holds, chunk 0 first: rank, rank + p, rank + 2p, ..."""
    return [virtual_stage(rank, chunk, num_ranks) for chunk in range(num_chunks)]


def rank_chunks(stages: Sequence[T], rank: int, num_ranks: int) -> list[T]:
    """From all p·v stages in model order, the ones ``rank`` holds (its chunks, in order)."""
    if num_ranks < 1 or len(stages) % num_ranks:
        raise ValueError(f"{len(stages)} stages cannot be dealt evenly to {num_ranks} ranks")
    num_chunks = len(stages) // num_ranks
    return [stages[stage] for stage in rank_stages(rank, num_ranks, num_chunks)]
