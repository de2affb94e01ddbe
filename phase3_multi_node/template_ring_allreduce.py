# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
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

**Speed** (guidelines.md#speed): the goal is gloo's own all-reduce. Given: each chunk is cut
into segments of ``segment_bytes`` (one message each, ``RingPlan.pieces``), receive buffers come
from a pool kept between calls, and messages travel on
:class:`~phase3_multi_node.ring_links.RingLinks` (a gloo connection per direction). When each
message is posted, what waits for what, and whether the two halves overlap, are yours.
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
ALL_GATHER_TAG = 1  # the all-gather's messages
_POOL = BufferPool()  # receive buffers, one per slot, kept between calls

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
    # TODO 3.1: cut numel elements into n contiguous chunks, the pieces of torch.tensor_split
    # Invariant: the chunks cover 0..numel exactly, in order, without overlap, and equal
    #   torch.tensor_split's pieces for any numel >= 0 and n >= 1.
    # Hint 1: what does torch.tensor_split make of 10 elements in 4 pieces, and of 2 in 3?
    # More hints: uv run python -m tests.hint 3.1
    # See guidelines.md#31-the-ring-all-reduce
    raise NotImplementedError(
        "TODO 3.1: cut numel elements into n contiguous chunks, the pieces of torch.tensor_split "
        "(see phase3_multi_node/guidelines.md#31-the-ring-all-reduce)"
    )


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
    # TODO 3.1: the reduce-scatter's n-1 steps: afterwards chunk r of flat is fully reduced
    # Invariant: at every step each rank sends one chunk to its right and receives one from
    #   its left; after the last step chunk r of flat holds every rank's contribution, each
    #   added once; nothing blocks in a send (every rank sends at the same time); the sends'
    #   works are returned, not waited for; with forward_own, chunk r's segments also leave
    #   under ALL_GATHER_TAG once final.
    # Hint 1: trips end at their owner: walk the guide's 4-rank table backwards from its last
    #   step to find what rank r sends and receives at step 0.
    # More hints: uv run python -m tests.hint 3.1
    # See guidelines.md#31-the-ring-all-reduce
    raise NotImplementedError(
        "TODO 3.1: the reduce-scatter's n-1 steps: afterwards chunk r of flat is fully reduced "
        "(see phase3_multi_node/guidelines.md#31-the-ring-all-reduce)"
    )


def _post_all_gather_receives(plan: RingPlan) -> Receives:
    """Post every irecv of the all-gather, step by step, straight into ``plan.flat``."""
    # TODO 3.1: post the all-gather's receives, each into its final place in flat
    # Invariant: one list per step, in step order, of (the view of flat, its irecv) for every
    #   segment of the chunk that arrives at that step, under ALL_GATHER_TAG; nothing is sent
    #   here and nothing waited for.
    # Hint 1: at step 0 each rank sends the chunk it owns, and afterwards what it just
    #   received.
    # More hints: uv run python -m tests.hint 3.1
    # See guidelines.md#31-the-ring-all-reduce
    raise NotImplementedError(
        "TODO 3.1: post the all-gather's receives, each into its final place in flat "
        "(see phase3_multi_node/guidelines.md#31-the-ring-all-reduce)"
    )


def _finish_all_gather(
    plan: RingPlan, receives: Receives, sends: list[dist.Work | None]
) -> None:
    """Wait for the all-gather's receives in order, forwarding each; then for every send.

    ``sends`` already holds the first step's sends (this rank's own chunk), in flight.
    """
    # TODO 3.1: complete the all-gather: every chunk of flat final, every send waited for
    # Invariant: what rank r receives at step s it sends at step s+1, as it is (copied, never
    #   reduced again); every isend (those passed in included) is waited for before returning;
    #   no all-gather send is waited for while all-gather receives are still pending.
    # Hint 1: the receives are posted already, in step order.
    # More hints: uv run python -m tests.hint 3.1
    # See guidelines.md#31-the-ring-all-reduce
    raise NotImplementedError(
        "TODO 3.1: complete the all-gather: every chunk of flat final, every send waited for "
        "(see phase3_multi_node/guidelines.md#31-the-ring-all-reduce)"
    )


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
    # TODO 3.1: compose the two halves in place, the all-gather under way at the seam
    # Invariant: afterwards tensor holds the reduction on every rank, bitwise the same; every
    #   rank sent 2(n-1)/n·S bytes, all to its right; the all-gather's first step leaves
    #   while the reduce-scatter's last step runs.
    # Hint 1: all_gather_ring shows the all-gather's helpers used alone.
    # More hints: uv run python -m tests.hint 3.1
    # See guidelines.md#31-the-ring-all-reduce
    raise NotImplementedError(
        "TODO 3.1: compose the two halves in place, the all-gather under way at the seam "
        "(see phase3_multi_node/guidelines.md#31-the-ring-all-reduce)"
    )
