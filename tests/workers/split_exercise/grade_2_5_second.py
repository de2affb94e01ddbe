"""The second grader file of exercise 2.5 in these cases (see grade_2_5_first.py)."""

from __future__ import annotations

from grade_2_5_first import rank_one_skips_the_barrier
from grading import exercise, world


@exercise("2.5")
def test_would_hang_again_in_the_second_file() -> None:
    world(rank_one_skips_the_barrier, 2)
