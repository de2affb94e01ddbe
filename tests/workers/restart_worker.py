"""A tiny training loop for torchrun tests: all-reduce a value for a few steps, fail on demand.

``uv run torchrun --standalone --nproc-per-node=2 -m tests.workers.restart_worker`` prints one
``RESULT {...}`` line per rank. ``DTFS_FAIL=kill:rank=1:step=2`` makes rank 1 die at step 2 of
restart attempt 0 (see course/failure_injection.py); under ``--max-restarts=1`` the
next attempt starts again from step 0 and must print what an uninterrupted run prints.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from course.distributed import cleanup_distributed, setup_distributed
from course.failure_injection import maybe_fail

STEPS = 4


def uninterrupted(world_size: int, steps: int = STEPS) -> float:
    """The value every rank ends with when nothing fails (the loop below, in one process)."""
    values = [float(rank + 1) for rank in range(world_size)]
    for step in range(steps):
        mean = sum(values) / world_size
        values = [mean + step] * world_size
    return values[0]


def main() -> None:
    # a worker forked from course.forked_workers_agent starts with the agent's torch._dynamo
    start = {"dynamo_from_agent": "torch._dynamo" in sys.modules}
    print("START " + json.dumps(start), flush=True)
    info = setup_distributed(timeout_seconds=30)
    value = torch.tensor([float(info.rank + 1)], dtype=torch.float64)
    for step in range(STEPS):
        maybe_fail(step)
        dist.all_reduce(value)
        value = value / info.world_size + step
    result = {
        "rank": info.rank,
        "world_size": info.world_size,
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1")),
        "value": value.item(),
    }
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    cleanup_distributed()


if __name__ == "__main__":
    main()
