"""Print what torchrun told this worker about its node, and check an all-reduce across nodes.

Run by tests/test_torchrun.py under two agents on loopback: each prints one ``NODE {...}`` line
(its arguments too: each agent may be given its own).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from course.distributed import cleanup_distributed, setup_distributed

VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")


def main() -> None:
    info = setup_distributed(timeout_seconds=30)
    total = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(total)
    seen = {name: os.environ.get(name) for name in VARS}
    print("NODE " + json.dumps({**seen, "sum": total.item(), "argv": sys.argv[1:]}), flush=True)
    dist.barrier()
    cleanup_distributed()


if __name__ == "__main__":
    main()
