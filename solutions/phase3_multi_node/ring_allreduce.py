"""Exercise 3.1: the ring all-reduce, reduce-scatter then all-gather around a ring of ranks.

Rank r talks only to its two neighbours: it sends to ``right = (r + 1) % n`` and receives from
``left = (r - 1) % n``. The tensor is cut into n chunks (:func:`chunk_bounds`, the pieces of
``torch.tensor_split``). In the **reduce-scatter**, at step s (0 .. n-2) rank r sends chunk
``(r - 1 - s) % n`` and receives chunk ``(r - 2 - s) % n``, which it reduces into its own copy:
each chunk travels once around the ring collecting one contribution per hop, and after n-1 steps
rank r holds chunk r fully reduced. In the **all-gather**, at step s rank r sends chunk
``(r - s) % n`` and receives chunk ``(r - 1 - s) % n``: each reduced chunk travels around again,
copied as it is. Every rank sends 2(n-1) chunks, 2(n-1)/n·S bytes for a tensor of S bytes,
which no all-reduce can beat (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for
clusters of workstations", JPDC 69(2), 2009). The time is 2(n-1)·alpha + 2(n-1)/n·S·beta: the
bandwidth term stays below 2·S·beta however many ranks there are, the latency term grows with
n. This is the algorithm Baidu brought to deep learning ("Bringing HPC techniques to deep
learning", A. Gibiansky, 2017; baidu-research/baidu-allreduce), that Horovod built on, and that
NCCL runs as ``NCCL_ALGO=Ring``.

**Bitwise agreement.** Each chunk is reduced once, by the hops of its own trip (starting at rank
``c + 1`` for chunk c), and then copied everywhere: every rank ends with the same bits, though
not necessarily the bits of ``dist.all_reduce``, whose order of additions differs.

**Speed.** A plain loop (post isend and irecv, wait, reduce, next step) leaves the link idle while
the reduction runs and the CPU idle while the bytes travel. Here each chunk is cut into segments
of ``segment_bytes``: a segment is reduced as soon as it arrives and forwarded at once, while the
next segments are still on the wire (the pipelining of NCCL's and gloo's rings: gloo/allreduce.cc
and NCCL's ``NCCL_BUFFSIZE`` slices); the receives of the next step are posted before the current
one is reduced; reductions write straight into the output view and the all-gather receives
straight into the output, so nothing is copied; receive buffers live in a pool reused across calls.
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

# 1 MiB segments: small enough that the reduction of one hides behind the transfer of the next,
# large enough that the ~50 us of Python and gloo per message stay a few percent (measured with
# benchmark_collectives --segment-kib; see guidelines.md#speed).
SEGMENT_BYTES = 1 << 20
_POOL = BufferPool()  # receive buffers of the reduce-scatter, kept between calls


def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of the n chunks of ``numel`` elements, as ``torch.tensor_split``.

    The first ``numel % n`` chunks have one element more than the others; chunks are empty when
    ``numel < n``. Every rank computes the same bounds, so sender and receiver agree on sizes.
    """
    if n < 1:
        raise ValueError(f"n={n}: a ring needs at least one rank")
    if numel < 0:
        raise ValueError(f"numel={numel} must be >= 0")
    # TODO 3.1: cut numel elements into n contiguous chunks whose sizes differ by at most one.
    # Invariant: the chunks cover 0..numel exactly, in order, without overlap; the first
    #   numel % n of them are one element longer (torch.tensor_split's pieces).
    # Hint 1: divmod(numel, n) gives the common size and how many chunks get one extra element.
    # Hint 2: walk i = 0..n-1 keeping a running start; chunk i has size base + (1 if i < extra
    #   else 0). Check it on numel = 10, n = 4: sizes 3, 3, 2, 2, and on numel = 2, n = 3.
    # See guidelines.md#31-the-ring-all-reduce
    # >>> solution
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
    # <<< solution


def reduce_scatter_ring(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    *,
    inplace: bool = False,
    segment_bytes: int = SEGMENT_BYTES,
) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` and return this rank's chunk of the result.

    Rank r (its rank in ``group``) gets chunk r of :func:`chunk_bounds` reduced over every rank:
    ``dist.reduce_scatter_tensor`` when the size divides by n. The input is left alone unless
    ``inplace=True``, in which case ``tensor`` is the workspace: the returned chunk is a view into
    it, and its other chunks are left holding partial reductions. Sends (n-1)/n·S bytes.
    """
    check_reduce_args(tensor, op)
    group, rank, n = group_and_size(group)
    flat = (tensor if inplace else tensor.clone()).view(-1)
    bounds = chunk_bounds(flat.numel(), n)
    if n == 1:
        return flat
    right, left = peer(group, (rank + 1) % n), peer(group, (rank - 1) % n)
    per_segment = max(1, segment_bytes // flat.element_size())

    # TODO 3.1: the n-1 reduce-scatter steps: send a chunk right, reduce the one from the left.
    # Invariant: at step s rank r sends chunk (r-1-s) % n and receives chunk (r-2-s) % n, which
    #   it reduces into flat with combine_; after step n-2 flat's chunk r holds every rank's
    #   contribution. Never block in a send: every rank sends at the same time.
    # Hint 1: post the irecv (into a separate buffer: flat's chunk still holds your own value)
    #   and the isend, then wait, then reduce. Peers are global ranks: right and left above.
    # Hint 2: the chunk you send at step s+1 is the one you reduced at step s, so forward it
    #   from flat right after reducing. To be fast, cut each chunk with segments(start, stop,
    #   per_segment), forward each segment as soon as it is reduced, post the next step's irecvs
    #   (into a second buffer: _POOL.get(size, flat, slot=step % 2)) before reducing this one,
    #   and wait for every isend before returning.
    # See guidelines.md#31-the-ring-all-reduce
    # >>> solution
    def post_receives(step: int) -> list[tuple[torch.Tensor, torch.Tensor, dist.Work | None]]:
        """Post the irecvs of one step's chunk, segment by segment, into a pooled buffer."""
        start, stop = bounds[(rank - 2 - step) % n]
        buffer = _POOL.get(stop - start, flat, slot=step % 2)
        return [
            (
                flat[lo:hi],
                buffer[lo - start : hi - start],
                dist.irecv(buffer[lo - start : hi - start], src=left, group=group),
            )
            for lo, hi in segments(start, stop, per_segment)
        ]

    pending = post_receives(0)  # receives first: the data can land the moment it is sent
    start, stop = bounds[(rank - 1) % n]
    sends = [
        dist.isend(flat[lo:hi], dst=right, group=group)
        for lo, hi in segments(start, stop, per_segment)
    ]
    for step in range(n - 1):
        following = post_receives(step + 1) if step + 1 < n - 1 else []
        for mine, incoming, work in pending:
            if work is not None:
                work.wait()
            combine_(mine, incoming, op)  # this rank's value (op) the partial from the left
            if step + 1 < n - 1:  # next step sends exactly this chunk: forward it now
                sends.append(dist.isend(mine, dst=right, group=group))
        pending = following
    wait_all(sends)
    # <<< solution
    start, stop = bounds[rank]
    return flat[start:stop]


def all_gather_ring(
    chunk: torch.Tensor,
    out: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    segment_bytes: int = SEGMENT_BYTES,
) -> torch.Tensor:
    """Fill ``out`` with every rank's chunk: rank r's ``chunk`` lands at chunk r of ``out``.

    ``chunk`` has the size of chunk r of :func:`chunk_bounds` for ``out.numel()`` elements (it may
    already be that view of ``out``, as in :func:`ring_all_reduce`). ``dist.all_gather_into_tensor``
    when the size divides by n. Returns ``out``. Sends (n-1)/n·S bytes.
    """
    check_reduce_args(out, ReduceOp.SUM, "out")
    check_reduce_args(chunk, ReduceOp.SUM, "chunk")
    group, rank, n = group_and_size(group)
    flat = out.view(-1)
    bounds = chunk_bounds(flat.numel(), n)
    start, stop = bounds[rank]
    if chunk.numel() != stop - start or chunk.dtype != out.dtype or chunk.device != out.device:
        raise ValueError(
            f"chunk ({chunk.numel()} elements, {chunk.dtype}, {chunk.device}) must be rank "
            f"{rank}'s chunk of out ({flat.numel()} elements split in {n}: chunk_bounds gives "
            f"{stop - start} elements, {out.dtype}, {out.device})"
        )
    own = flat[start:stop]
    if own.numel() and chunk.data_ptr() != own.data_ptr():
        own.copy_(chunk.view(-1))
    if n == 1:
        return out
    right, left = peer(group, (rank + 1) % n), peer(group, (rank - 1) % n)
    per_segment = max(1, segment_bytes // flat.element_size())
    # TODO 3.1: the n-1 all-gather steps: pass every reduced chunk once around the ring.
    # Invariant: at step s rank r sends chunk (r-s) % n and receives chunk (r-1-s) % n straight
    #   into its place in flat; chunks are copied, never reduced again, so every rank ends with
    #   the same bits. Never block in a send.
    # Hint 1: at step 0 you send your own chunk; what you receive at step s is what you send at
    #   step s+1. Receive into flat itself: no buffer is needed.
    # Hint 2: post every irecv up front (each chunk has its own place in flat), then send your
    #   own chunk's segments, then walk the steps in order: wait for each received segment and, but
    #   at the last step, forward it to the right at once. Wait for every isend before returning.
    # See guidelines.md#31-the-ring-all-reduce
    # >>> solution
    receives = []
    for step in range(n - 1):
        lo_chunk, hi_chunk = bounds[(rank - 1 - step) % n]
        receives.append(
            [
                (flat[lo:hi], dist.irecv(flat[lo:hi], src=left, group=group))
                for lo, hi in segments(lo_chunk, hi_chunk, per_segment)
            ]
        )
    sends = [
        dist.isend(flat[lo:hi], dst=right, group=group)
        for lo, hi in segments(start, stop, per_segment)
    ]
    for step, posted in enumerate(receives):
        for piece, work in posted:
            if work is not None:
                work.wait()
            if step + 1 < n - 1:
                sends.append(dist.isend(piece, dst=right, group=group))
    wait_all(sends)
    # <<< solution
    return out


def ring_all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    *,
    segment_bytes: int = SEGMENT_BYTES,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group``: reduce-scatter, then all-gather. Returns it.

    Any size (1, smaller than the group, not divisible by it), any dtype ``combine_`` handles;
    SUM, PRODUCT, MIN, MAX. Every rank sends 2(n-1)/n·S bytes, S = the tensor's bytes (exactly
    S - |chunk r| + S - |chunk r+1| when n does not divide the size).
    """
    check_reduce_args(tensor, op)
    # TODO 3.1: compose the two halves, in place and without copying the tensor.
    # Invariant: afterwards tensor holds the reduction on every rank, bitwise the same.
    # Hint 1: reduce_scatter_ring(..., inplace=True) returns a view of tensor's own chunk, and
    #   all_gather_ring accepts that view as its chunk.
    # See guidelines.md#31-the-ring-all-reduce
    # >>> solution
    chunk = reduce_scatter_ring(tensor, op, group, inplace=True, segment_bytes=segment_bytes)
    all_gather_ring(chunk, tensor, group, segment_bytes=segment_bytes)
    return tensor
    # <<< solution
