"""Exercise 3.1: the ring all-reduce, reduce-scatter then all-gather around a ring of ranks.

Rank r talks only to its two neighbours: it sends to the next rank of the ring (its *right*,
``(r + 1) % n``) and receives from the previous one (its *left*). The tensor is cut into n chunks
(:func:`chunk_bounds`, the pieces of ``torch.tensor_split``). Two halves follow, n-1 steps each,
and at every step every rank sends exactly one chunk and receives exactly one:

* **reduce-scatter**: each chunk travels once around the ring, and every rank it passes adds its
  own contribution before passing it on; the trip of chunk r ends at rank r, which then holds
  chunk r reduced over every rank. What a rank sends at a step is what it reduced at the step
  before. Which chunk a rank sends *first* follows from where each trip must end: work it out
  on the 4-rank table of guidelines.md#31-the-ring-all-reduce.
* **all-gather**: each reduced chunk travels around again, from its owner, copied as it is.

Every rank sends 2(n-1) chunks, 2(n-1)/n·S bytes for a tensor of S bytes, which no all-reduce
can beat (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 69(2), 2009). The time is 2(n-1)·alpha + 2(n-1)/n·S·beta: the bandwidth
term stays below 2·S·beta however many ranks there are, the latency term grows with n. This is
the algorithm Baidu brought to deep learning ("Bringing HPC techniques to deep learning", A.
Gibiansky, 2017; baidu-research/baidu-allreduce), that Horovod built on, and that NCCL runs as
``NCCL_ALGO=Ring``.

**Bitwise agreement.** Each chunk is reduced once, by the hops of its own trip, and then copied
everywhere: every rank ends with the same bits, though not necessarily the bits of
``dist.all_reduce``, whose order of additions differs.

**Speed** (guidelines.md#speed). Each chunk is cut into segments of ``segment_bytes``, reduced
as they arrive and forwarded at once while later ones are on the wire (the pipelining of gloo's
and NCCL's rings); every receive is posted before the first send; nothing is copied (reductions
write into the tensor, the all-gather receives into it, receive buffers are pooled);
:func:`ring_all_reduce` overlaps the halves at their seam; messages travel on
:class:`~phase3_multi_node.ring_links.RingLinks` (a gloo connection per direction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from phase3_multi_node.collective_support import (
    BufferPool,
    ReduceOp,
    check_reduce_args,
    combine_,
    group_and_size,
    segments,
    wait_all,
)
from phase3_multi_node.ring_links import RingLinks

# 2 MiB segments: small enough that the reduction of one hides behind the transfer of the next,
# large enough that the fixed cost of Python and gloo per message stays small (compare sizes
# with benchmark_collectives --segment-kib; guidelines.md#speed).
SEGMENT_BYTES = 2 << 20
REDUCE_SCATTER_TAG = 0
ALL_GATHER_TAG = 1  # own tag: the all-gather's receives are posted while reduce-scatter runs
_POOL = BufferPool()  # the reduce-scatter's receive buffers, one per step, kept between calls

Receives = list[list[tuple[torch.Tensor, "dist.Work | None"]]]  # per step: (place, its irecv)


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
    # Hint 1: one integer division of numel by n gives both the common size and how many
    #   chunks are one element longer.
    # Hint 2: walk the chunks in order keeping a running start; a chunk is one element longer
    #   when its index is below the remainder. Check it on numel = 10, n = 4 (sizes 3, 3, 2, 2)
    #   and on numel = 2, n = 3 (1, 1, 0).
    # Hint 3: divmod of numel by n gives (base, extra); chunk i has base + 1 elements when
    #   i < extra and base otherwise, and starts where chunk i − 1 stopped (chunk 0 at 0).
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


@dataclass(frozen=True)
class RingPlan:
    """One call's layout: the flat tensor, its n chunks, this rank's links, the segment size.

    Every rank builds the same plan from the same arguments, so sender and receiver cut a chunk
    into the same segments and no message needs a header.
    """

    flat: torch.Tensor
    bounds: list[tuple[int, int]]
    links: RingLinks
    per_segment: int  # elements per segment

    @classmethod
    def build(
        cls,
        flat: torch.Tensor,
        group: dist.ProcessGroup | None,
        segment_bytes: int,
        *,
        per_direction: bool = True,
    ) -> RingPlan:
        """The plan for ``flat`` on ``group``; ``per_direction``: see :class:`RingLinks`."""
        links = RingLinks.of(group, per_direction=per_direction)
        per_segment = max(1, segment_bytes // flat.element_size())
        return cls(flat, chunk_bounds(flat.numel(), links.size), links, per_segment)

    @property
    def rank(self) -> int:
        return self.links.rank

    @property
    def n(self) -> int:
        return self.links.size

    def chunk(self, index: int) -> torch.Tensor:
        """Chunk ``index % n`` of the flat tensor (a view)."""
        start, stop = self.bounds[index % self.n]
        return self.flat[start:stop]

    def pieces(self, index: int) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` element ranges of chunk ``index % n``'s segments (none when empty)."""
        return segments(*self.bounds[index % self.n], self.per_segment)


def _reduce_scatter_steps(
    plan: RingPlan, op: object, *, forward_own: bool
) -> list[dist.Work | None]:
    """Run the n-1 reduce-scatter steps on ``plan.flat``; return the sends still in flight.

    Afterwards chunk r of ``plan.flat`` holds the reduction over every rank. With
    ``forward_own=True`` each segment of chunk r is also sent on to the right, under
    ``ALL_GATHER_TAG``, the moment its last reduction is done: the all-gather's first step.
    """
    flat, links, rank, n = plan.flat, plan.links, plan.rank, plan.n
    # TODO 3.1: the n-1 reduce-scatter steps: send a chunk right, reduce the one from the left.
    # Invariant: at every step each rank sends one chunk to its right and receives one from its
    #   left, which it reduces (combine_) into its own copy of that chunk in flat; what it sends
    #   at step s+1 is what it reduced at step s; after step n-2 chunk r of flat holds every
    #   rank's contribution. Never block in a send: every rank sends at the same time.
    # Hint 1: first find which chunk rank r sends at step 0 and which it receives, for any n:
    #   trips end at their owner, so walk the guide's 4-rank table backwards from its last
    #   step. A received chunk goes into a separate buffer (_POOL.get), not into flat: flat's
    #   chunk still holds your own value. Return the isends' works without waiting for them.
    # Hint 2: post every step's receives before the first send (each step into its own pool
    #   slot, one receive per segment of the chunk), then send the first chunk; then, step by
    #   step and segment by segment: wait for the receive, reduce it into flat, and send that
    #   reduced segment on at once (it is what the next step sends). At the last step the
    #   reduced segment belongs to your own chunk: send it on only if forward_own, under the
    #   all-gather's tag.
    # Hint 3: at step s rank r sends chunk r − 1 − s and receives chunk r − 2 − s, both mod n
    #   (plan.pieces(i) and plan.chunk(i) reduce any integer i mod n themselves). Step s's
    #   buffer is the pool's slot s, sized to the arriving chunk; a segment [lo, hi) of that
    #   chunk (which starts at `start`) lands in the buffer's [lo − start, hi − start) through
    #   links.irecv under REDUCE_SCATTER_TAG, and is reduced into flat's [lo, hi) by combine_;
    #   links.isend sends flat's views.
    # See guidelines.md#31-the-ring-all-reduce
    # >>> solution
    incoming = []  # per step: (this rank's view of the chunk, its receive buffer, the irecv)
    for step in range(n - 1):  # every receive first: data can land the moment it is sent
        start, stop = plan.bounds[(rank - 2 - step) % n]
        buffer = _POOL.get(stop - start, flat, slot=step)
        incoming.append(
            [
                (
                    flat[lo:hi],
                    buffer[lo - start : hi - start],
                    links.irecv(buffer[lo - start : hi - start], REDUCE_SCATTER_TAG),
                )
                for lo, hi in plan.pieces(rank - 2 - step)
            ]
        )
    sends = [links.isend(flat[lo:hi], REDUCE_SCATTER_TAG) for lo, hi in plan.pieces(rank - 1)]
    for step, posted in enumerate(incoming):
        for mine, received, work in posted:
            if work is not None:
                work.wait()
            combine_(mine, received, op)  # this rank's value (op) the partial from the left
            if step < n - 2:  # the next step sends exactly this segment: forward it now
                sends.append(links.isend(mine, REDUCE_SCATTER_TAG))
            elif forward_own:  # chunk r's segment is final: the all-gather's first step
                sends.append(links.isend(mine, ALL_GATHER_TAG))
    return sends
    # <<< solution


def _post_all_gather_receives(plan: RingPlan) -> Receives:
    """Post every irecv of the all-gather, step by step, straight into ``plan.flat``."""
    # TODO 3.1: post the all-gather's receives, each into its final place in flat.
    # Invariant: one list per step, in step order, holding (the view of flat, its irecv) for
    #   every segment of the chunk that arrives at that step, under ALL_GATHER_TAG; nothing is
    #   sent here and nothing waited for.
    # Hint 1: at step 0 each rank sends the chunk it owns, and afterwards what it just
    #   received: so the chunk arriving at step s is the one your left neighbour sends then.
    #   Receive into flat itself (no buffer): the data is final when it lands.
    # Hint 2: for each step, the index of the arriving chunk, then one receive per segment of
    #   it (plan.pieces lists a chunk's segments), each into that segment's view of flat.
    # Hint 3: at step s rank r receives chunk r − 1 − s (mod n), for s from 0 to n − 2; for
    #   each segment [lo, hi) of it, the pair (flat's view from lo to hi, an irecv by
    #   plan.links into that same view under ALL_GATHER_TAG).
    # See guidelines.md#31-the-ring-all-reduce
    # >>> solution
    rank, n = plan.rank, plan.n
    return [
        [
            (plan.flat[lo:hi], plan.links.irecv(plan.flat[lo:hi], ALL_GATHER_TAG))
            for lo, hi in plan.pieces(rank - 1 - step)
        ]
        for step in range(n - 1)
    ]
    # <<< solution


def _finish_all_gather(
    plan: RingPlan, receives: Receives, sends: list[dist.Work | None]
) -> None:
    """Wait for the all-gather's receives in order, forwarding each; then for every send.

    ``sends`` already holds the first step's sends (this rank's own chunk), in flight.
    """
    # TODO 3.1: the all-gather's steps: pass every received chunk on to the right, once.
    # Invariant: what rank r receives at step s it sends at step s+1, as it is (copied, never
    #   reduced again: every rank ends with the same bits); the last step's chunk is not sent
    #   on (its right neighbour started it). Every isend is waited for before returning: the
    #   caller may overwrite the tensor at once.
    # Hint 1: the receives are already posted, in step order: a segment is final the moment it
    #   lands, so it can be passed on at once. Waiting for a send before the next receive
    #   serializes the ring; wait for the sends only at the end.
    # Hint 2: step by step, segment by segment: wait for the segment's receive; unless this is
    #   the last step, post its send to the right under the all-gather's tag and keep the work.
    #   When every receive is done, wait for every send (those already in `sends` included).
    # Hint 3: after each segment's receive completes, at steps 0 to n − 3 only, an isend by
    #   plan.links of that same view under ALL_GATHER_TAG, its work appended to sends; after
    #   the loop, one wait_all over sends.
    # See guidelines.md#31-the-ring-all-reduce
    # >>> solution
    for step, posted in enumerate(receives):
        for piece, work in posted:
            if work is not None:
                work.wait()
            if step + 1 < plan.n - 1:
                sends.append(plan.links.isend(piece, ALL_GATHER_TAG))
    wait_all(sends)
    # <<< solution


def _send_own_chunk(plan: RingPlan) -> list[dist.Work | None]:
    """The all-gather's first step on its own: this rank's chunk, segment by segment."""
    return [
        plan.links.isend(plan.flat[lo:hi], ALL_GATHER_TAG) for lo, hi in plan.pieces(plan.rank)
    ]


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
    flat = (tensor if inplace else tensor.clone()).view(-1)
    plan = RingPlan.build(flat, group, segment_bytes)
    if plan.n > 1:
        wait_all(_reduce_scatter_steps(plan, op, forward_own=False))
    return plan.chunk(plan.rank)


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
    start, stop = chunk_bounds(flat.numel(), n)[rank]
    if chunk.numel() != stop - start or chunk.dtype != out.dtype or chunk.device != out.device:
        raise ValueError(
            f"chunk ({chunk.numel()} elements, {chunk.dtype}, {chunk.device}) must be rank "
            f"{rank}'s chunk of out ({flat.numel()} elements split in {n}: chunk_bounds gives "
            f"{stop - start} elements, {out.dtype}, {out.device})"
        )
    own = flat[start:stop]
    if own.numel() and chunk.data_ptr() != own.data_ptr():
        own.copy_(chunk.view(-1))
    plan = RingPlan.build(flat, group, segment_bytes)
    if plan.n > 1:
        receives = _post_all_gather_receives(plan)
        sends = _send_own_chunk(plan)
        _finish_all_gather(plan, receives, sends)
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
    plan = RingPlan.build(tensor.view(-1), group, segment_bytes)
    if plan.n == 1:
        return tensor
    # TODO 3.1: compose the two halves in place, the all-gather starting at the seam.
    # Invariant: afterwards tensor holds the reduction on every rank, bitwise the same, and
    #   every rank sent 2(n-1)/n·S bytes, all to its right.
    # Hint 1: the helpers above are the two halves: _reduce_scatter_steps leaves chunk r
    #   reduced in plan.flat, _post_all_gather_receives + _finish_all_gather pass the chunks
    #   around (see all_gather_ring for them used alone).
    # Hint 2: the all-gather's receives can be posted before the reduce-scatter starts: gloo
    #   pairs messages from one neighbour and tag in posting order, and their own tag keeps
    #   them apart from the reduce-scatter's; and no all-gather data can arrive before the
    #   chunk it belongs to is final everywhere. The all-gather's first step (your own chunk,
    #   which all_gather_ring sends with _send_own_chunk) can then leave from inside the
    #   reduce-scatter, segment by segment, the moment each is final.
    # Hint 3: three calls in this order: _post_all_gather_receives on the plan; then
    #   _reduce_scatter_steps with forward_own set to True, whose returned sends already hold
    #   your own chunk's segments, in flight; then _finish_all_gather with those receives and
    #   sends. Return the tensor.
    # See guidelines.md#31-the-ring-all-reduce
    # >>> solution
    receives = _post_all_gather_receives(plan)
    sends = _reduce_scatter_steps(plan, op, forward_own=True)
    _finish_all_gather(plan, receives, sends)
    return tensor
    # <<< solution
