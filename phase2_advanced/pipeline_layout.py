"""Where each pipeline stage lives: the stage-to-rank rules (placements), used by everything in 2.5.

A pipeline of p ranks, each holding v model chunks, has p·v *virtual stages* (the pieces of the
model, in order). A *placement* deals them to the ranks; a schedule is written for one placement
(``pipeline_schedules.placement_of``), and the executor, the simulator, the demo and the tests
all ask these functions, so each rule is written once.

* ``"loop"`` (Megatron-LM's interleaving; GPipe and 1F1B with v = 1): dealt round-robin,
  chunk-major. Rank r's chunk c is virtual stage ``c·p + r``: stage s lives on rank ``s mod p``
  as its chunk ``s // p``, and a micro-batch loops through the ranks v times::

      p = 2, v = 2:   stage 0 -> rank 0 chunk 0,  stage 1 -> rank 1 chunk 0,
                      stage 2 -> rank 0 chunk 1,  stage 3 -> rank 1 chunk 1

* ``"v"`` (ZB-V of Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, and DeepSeek's
  DualPipeV; torch's ``generate_stage_to_rank_mapping(..., style="v")``): the even chunks go
  down the ranks and the odd chunks come back up, so with v = 2 rank r holds stages r and
  2p - 1 - r. A micro-batch goes down to the last rank and turns there (stages p - 1 and p are
  on the same rank: no message), and the last stage is on rank 0, beside the first::

      p = 2, v = 2:   stage 0 -> rank 0 chunk 0,  stage 1 -> rank 1 chunk 0,
                      stage 2 -> rank 1 chunk 1,  stage 3 -> rank 0 chunk 1

With v = 1 both say stage s is rank s. Ranks are ranks *within* the pipeline's process group (the
default group unless one is given); the executor maps them to global ranks for its messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeVar

T = TypeVar("T")

LOOP: Literal["loop"] = "loop"
VEE: Literal["v"] = "v"
PLACEMENTS = (LOOP, VEE)
Placement = Literal["loop", "v"]


def check_placement(placement: str) -> None:
    """Refuse a placement that is neither ``"loop"`` nor ``"v"``."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}: choose one of {', '.join(PLACEMENTS)}")


def _turned(chunk: int, placement: str) -> bool:
    """Whether ``chunk`` runs back up the ranks (the odd chunks of a V)."""
    check_placement(placement)
    return placement == VEE and chunk % 2 == 1


def virtual_stage(rank: int, chunk: int, num_ranks: int, placement: str = LOOP) -> int:
    """The position in the whole model of ``rank``'s ``chunk`` under ``placement``."""
    position = num_ranks - 1 - rank if _turned(chunk, placement) else rank
    return chunk * num_ranks + position


def stage_rank(stage: int, num_ranks: int, placement: str = LOOP) -> int:
    """The rank (within the pipeline group) that holds virtual stage ``stage``."""
    position = stage % num_ranks
    return num_ranks - 1 - position if _turned(stage // num_ranks, placement) else position


def stage_chunk(stage: int, num_ranks: int, placement: str = LOOP) -> int:
    """Which of its chunks virtual stage ``stage`` is on the rank that holds it (the same
    under both placements: chunk c holds the stages c·p to c·p + p - 1)."""
    check_placement(placement)
    return stage // num_ranks


def rank_stages(rank: int, num_ranks: int, num_chunks: int, placement: str = LOOP) -> list[int]:
    """The virtual stages ``rank`` holds, chunk 0 first."""
    return [virtual_stage(rank, chunk, num_ranks, placement) for chunk in range(num_chunks)]


def rank_chunks(stages: Sequence[T], rank: int, num_ranks: int, placement: str = LOOP) -> list[T]:
    """From all p·v stages in model order, the ones ``rank`` holds (its chunks, in order)."""
    if num_ranks < 1 or len(stages) % num_ranks:
        raise ValueError(f"{len(stages)} stages cannot be dealt evenly to {num_ranks} ranks")
    num_chunks = len(stages) // num_ranks
    return [stages[stage] for stage in rank_stages(rank, num_ranks, num_chunks, placement)]
