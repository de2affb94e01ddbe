"""One exercise's tests in two grader files: with parallel workers both must run in one worker.

Run by tests/test_harness.py in a pytest of its own (the names do not start with ``test_``, and no
``test_phaseN.py`` expands this folder). The first file's world hangs; the second file's world
must then be skipped as blocked by that hang, which only happens in the same worker.
"""

from __future__ import annotations

import torch.distributed as dist
from grading import exercise, world


def rank_one_skips_the_barrier() -> None:
    if dist.get_rank() == 0:
        dist.barrier()


@exercise("2.5")
def test_hangs_in_the_first_file() -> None:
    world(rank_one_skips_the_barrier, 2)
