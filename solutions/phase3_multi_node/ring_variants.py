"""Other rings, for the benchmark's ablation: what pipelining, avoiding copies, reusing buffers and
overlapping the two halves each buy. Not an exercise;
``benchmark_collectives --algorithms ring_plain,ring_unpipelined,ring,ring_fused`` runs them
beside the exercise's ring.

* :func:`plain_ring_all_reduce` is the first ring most people write: each step sends a copy of the
  chunk and receives into a freshly allocated buffer, waits for both, then reduces; the all-gather
  receives into a buffer too and copies it into place. Every call allocates S/n-sized buffers
  (page faults on first touch) and copies S bytes more than it must.
* ``ring_unpipelined`` (in the benchmark) is the exercise's ring with one segment per chunk: no
  copies, pooled buffers, receives posted a step ahead, but each chunk is reduced only once all
  of it has arrived.
* :func:`fused_ring_all_reduce` goes one step further than the exercise: the all-gather starts
  while the reduce-scatter's last step is still running (see its docstring).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from solutions.phase3_multi_node.collective_support import (
    BufferPool,
    ReduceOp,
    check_reduce_args,
    combine_,
    group_and_size,
    peer,
    segments,
    wait_all,
)
from solutions.phase3_multi_node.ring_allreduce import SEGMENT_BYTES, chunk_bounds

_FUSED_POOL = BufferPool()  # the fused ring's reduce-scatter receive buffers


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


ALL_GATHER_TAG = 1  # the fused ring's all-gather messages; the reduce-scatter's use tag 0


def fused_ring_all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    *,
    segment_bytes: int = SEGMENT_BYTES,
) -> torch.Tensor:
    """The exercise's ring with its two halves overlapped at the seam, as gloo's ring does.

    :func:`~solutions.phase3_multi_node.ring_allreduce.ring_all_reduce` runs the all-gather after
    the reduce-scatter has finished, so the link idles while the last segments are reduced and
    the all-gather's receives are posted. Here the all-gather's receives are posted first, under
    their own tag (so they cannot be matched with the reduce-scatter's messages from the same
    neighbour), straight into their final place; each segment of this rank's own chunk is sent
    on as the all-gather's first step the moment its reduction is done. Posting early is safe:
    a chunk's all-gather data can only arrive once that chunk is fully reduced, which needs every
    message this rank sends or reduces for it to be done already. Same bytes, same bits.
    """
    check_reduce_args(tensor, op)
    group, rank, n = group_and_size(group)
    flat = tensor.view(-1)
    bounds = chunk_bounds(flat.numel(), n)
    if n == 1:
        return tensor
    right, left = peer(group, (rank + 1) % n), peer(group, (rank - 1) % n)
    per_segment = max(1, segment_bytes // flat.element_size())

    def pieces(chunk: int) -> list[tuple[int, int]]:
        return segments(*bounds[chunk % n], per_segment)

    gathered = [  # the all-gather's receives, step by step, posted before anything is sent
        [
            (flat[lo:hi], dist.irecv(flat[lo:hi], src=left, group=group, tag=ALL_GATHER_TAG))
            for lo, hi in pieces(rank - 1 - step)
        ]
        for step in range(n - 1)
    ]

    def post_receives(step: int) -> list[tuple[torch.Tensor, torch.Tensor, dist.Work | None]]:
        start = bounds[(rank - 2 - step) % n][0]
        buffer = _FUSED_POOL.get(bounds[(rank - 2 - step) % n][1] - start, flat, slot=step % 2)
        return [
            (
                flat[lo:hi],
                buffer[lo - start : hi - start],
                dist.irecv(buffer[lo - start : hi - start], src=left, group=group),
            )
            for lo, hi in pieces(rank - 2 - step)
        ]

    pending = post_receives(0)
    sends = [dist.isend(flat[lo:hi], dst=right, group=group) for lo, hi in pieces(rank - 1)]
    for step in range(n - 1):
        last = step == n - 2
        following = [] if last else post_receives(step + 1)
        for mine, incoming, work in pending:
            if work is not None:
                work.wait()
            combine_(mine, incoming, op)
            tag = ALL_GATHER_TAG if last else 0  # the last step completes this rank's chunk
            sends.append(dist.isend(mine, dst=right, group=group, tag=tag))
        pending = following
    for step, posted in enumerate(gathered):
        for piece, work in posted:
            if work is not None:
                work.wait()
            if step < n - 2:
                sends.append(dist.isend(piece, dst=right, group=group, tag=ALL_GATHER_TAG))
    wait_all(sends)
    return tensor
