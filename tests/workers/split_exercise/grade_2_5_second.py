"""The second grader file of exercise 2.5 in these cases (see grade_2_5_first.py)."""

from __future__ import annotations

import torch.distributed as dist
from grading import exercise, world


def rank_one_skips_the_barrier() -> None:
    if dist.get_rank() == 0:
        dist.barrier()


@exercise("2.5")
def test_would_hang_again_in_the_second_file() -> None:
    world(rank_one_skips_the_barrier, 2)
