"""Slower rings, for the benchmark's ablation: what pipelining, avoiding copies and reusing buffers
each buy. Not an exercise; ``benchmark_collectives --algorithms ring_plain,ring_unpipelined,ring``
runs them beside the exercise's ring.

* :func:`plain_ring_all_reduce` is the first ring most people write: each step sends a copy of the
  chunk and receives into a freshly allocated buffer, waits for both, then reduces; the all-gather
  receives into a buffer too and copies it into place. Every call allocates S/n-sized buffers
  (page faults on first touch) and copies S bytes more than it must.
* ``ring_unpipelined`` (in the benchmark) is the exercise's ring with one segment per chunk: no
  copies, pooled buffers, receives posted a step ahead, but each chunk is reduced only once all
  of it has arrived.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from solutions.phase3_multi_node.collective_support import (
    ReduceOp,
    check_reduce_args,
    combine_,
    group_and_size,
    peer,
    wait_all,
)


def plain_ring_all_reduce(
    tensor: torch.Tensor, op: object = ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The plain loop: correct, 2(n-1)/n·S bytes per rank, and slow (see the module docstring)."""
    check_reduce_args(tensor, op)
    group, rank, n = group_and_size(group)
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    right, left = peer(group, (rank + 1) % n), peer(group, (rank - 1) % n)
    for step in range(n - 1):
        sent, received = chunks[(rank - 1 - step) % n], chunks[(rank - 2 - step) % n]
        buffer = torch.empty_like(received)
        wait_all(
            [
                dist.isend(sent.clone(), dst=right, group=group),
                dist.irecv(buffer, src=left, group=group),
            ]
        )
        combine_(received, buffer, op)
    for step in range(n - 1):
        sent, received = chunks[(rank - step) % n], chunks[(rank - 1 - step) % n]
        buffer = torch.empty_like(received)
        wait_all(
            [
                dist.isend(sent.clone(), dst=right, group=group),
                dist.irecv(buffer, src=left, group=group),
            ]
        )
        received.copy_(buffer)
    return tensor
