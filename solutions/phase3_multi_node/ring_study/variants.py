"""Other rings, for the benchmark's ablation: what each technique of the exercise's ring buys.
Not an exercise; ``benchmarks.collectives --algorithms
ring_simple,ring_plain,ring_unpipelined,ring_unfused,ring_one_connection,ring,dist.all_reduce``
runs them beside the exercise's ring (``ring``).

* :func:`simple_ring_all_reduce` (``ring_simple``) is the straightforward correct ring on the
  exercise's helpers: receive buffers from a pool, the links of ``RingLinks`` (a connection per
  direction), one message per chunk; at each step it posts its receive and its send, waits for
  both, then reduces; the all-gather runs after the reduce-scatter, step by step, receiving
  straight into place. No segments, no overlap of the halves, nothing posted ahead.
* :func:`plain_ring_all_reduce` (``ring_plain``) is the first ring most people write: each step
  sends a copy of the chunk and receives into a freshly allocated buffer, waits for both, then
  reduces; the all-gather receives into a buffer too and copies it into place. Every call
  allocates S/n-sized buffers (page faults on first touch) and copies S bytes more than it must.
* ``ring_unpipelined`` (in the benchmark) is the exercise's ring with one segment per chunk: no
  copies, pooled buffers, receives posted up front, but each chunk is reduced only once all of it
  has arrived.
* :func:`unfused_ring_all_reduce` (``ring_unfused``) runs the exercise's two halves one after the
  other, as gloo's ring does: the all-gather starts once the whole reduce-scatter is done.
* :func:`one_connection_ring_all_reduce` (``ring_one_connection``) is the exercise's ring with
  both directions of a link on one gloo connection (see ring_links.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phase3_multi_node.collective_support import (
    BufferPool,
    ReduceOp,
    check_reduce_args,
    combine_,
    group_and_size,
    peer,
    wait_all,
)
from phase3_multi_node.ring_links import RingLinks
from solutions.phase3_multi_node import ring_allreduce as ring

_POOL = BufferPool()


def simple_ring_all_reduce(
    tensor: torch.Tensor, op: object = ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Step by step, one message per chunk, waiting for each step (see the module docstring)."""
    check_reduce_args(tensor, op)
    links = RingLinks.of(group)
    rank, n = links.rank, links.size
    if n == 1:
        return tensor
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    for step in range(n - 1):
        sent, received = chunks[(rank - 1 - step) % n], chunks[(rank - 2 - step) % n]
        buffer = _POOL.get(received.numel(), received)
        works = [links.irecv(buffer, 0)] if received.numel() else []
        works += [links.isend(sent, 0)] if sent.numel() else []
        wait_all(works)
        combine_(received, buffer, op)
    for step in range(n - 1):
        sent, received = chunks[(rank - step) % n], chunks[(rank - 1 - step) % n]
        works = [links.irecv(received, 1)] if received.numel() else []
        works += [links.isend(sent, 1)] if sent.numel() else []
        wait_all(works)
    return tensor


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


def unfused_ring_all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    *,
    segment_bytes: int = ring.SEGMENT_BYTES,
) -> torch.Tensor:
    """Reduce-scatter, wait for all of it, then all-gather: the two public halves composed."""
    chunk = ring.reduce_scatter_ring(tensor, op, group, inplace=True, segment_bytes=segment_bytes)
    return ring.all_gather_ring(chunk, tensor, group, segment_bytes=segment_bytes)


def one_connection_ring_all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    *,
    segment_bytes: int = ring.SEGMENT_BYTES,
) -> torch.Tensor:
    """The exercise's ring, with data to the right and from the left on the same connection."""
    check_reduce_args(tensor, op)
    plan = ring.RingPlan.build(tensor.view(-1), group, segment_bytes, per_direction=False)
    if plan.n > 1:
        receives = ring._post_all_gather_receives(plan)
        sends = ring._reduce_scatter_steps(plan, op, forward_own=True)
        ring._finish_all_gather(plan, receives, sends)
    return tensor
