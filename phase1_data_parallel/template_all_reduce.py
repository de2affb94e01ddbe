# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase1.py
"""Exercise 1.3: all-reduce built from point-to-point messages.

``dist.all_reduce(t)`` leaves on every rank the element-wise reduction (sum by default) of every
rank's ``t``. Here it is built twice from ``isend``/``irecv``, in place like the original:

* ``reduce_broadcast_all_reduce``: every rank sends its tensor to a root, the root reduces and
  sends the result back. The root sends and receives (n-1)·S bytes; the others S each. Simple,
  but the root's link carries everything: it does not scale.
* ``direct_exchange_all_reduce``: every rank sends its tensor to every other rank and reduces
  what it receives. One round of messages (lowest latency), but each rank sends (n-1)·S bytes.

Phase 3 builds the bandwidth-optimal ring (reduce-scatter + all-gather, 2(n-1)/n·S per rank) that
NCCL and gloo use for large tensors. The cost model (alpha-beta, Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH", 2005) is in guidelines.md.

Both functions reduce contributions in rank order 0, 1, ..., n-1 on every rank, so all ranks end
with bitwise-identical results even for floating point, where (a + b) + c != a + (b + c).

Both take ``group=``: inside a subgroup they use only its members. Ranks in the arguments of these
functions (``root``) are ranks *within* the group, 0 .. group size - 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp
SUPPORTED_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)


def combine_(accumulator: torch.Tensor, incoming: torch.Tensor, op: object) -> torch.Tensor:
    """``accumulator = accumulator (op) incoming``, in place; returns ``accumulator``."""
    if op == ReduceOp.SUM:
        return accumulator.add_(incoming)
    if op == ReduceOp.PRODUCT:
        return accumulator.mul_(incoming)
    if op == ReduceOp.MIN:
        return torch.minimum(accumulator, incoming, out=accumulator)
    if op == ReduceOp.MAX:
        return torch.maximum(accumulator, incoming, out=accumulator)
    raise ValueError(f"op={op} is not supported here: use one of SUM, PRODUCT, MIN, MAX")


def wait_all(works: Sequence[dist.Work | None]) -> None:
    """Wait for every pending isend/irecv (``None`` stands for an op that completed at once)."""
    for work in works:
        if work is not None:
            work.wait()


def check_all_reduce_args(tensor: torch.Tensor, op: object) -> None:
    """Refuse what ``dist.all_reduce`` refuses, with a message that says how to fix it."""
    if not tensor.is_contiguous():
        raise ValueError(
            f"tensor of shape {tuple(tensor.shape)} is not contiguous: call .contiguous() first "
            "(messages are sent from the tensor's memory as one block)"
        )
    if op not in SUPPORTED_OPS:
        raise ValueError(f"op={op} is not supported here: use one of SUM, PRODUCT, MIN, MAX")


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of the member ``group_rank`` of ``group`` (None: the default group).

    ``dist.send(dst=...)``, ``dist.irecv(src=...)`` and friends take GLOBAL ranks even when
    ``group=`` is given; a rank inside a subgroup must be mapped first.
    """
    size = dist.get_world_size(group)
    if not 0 <= group_rank < size:
        raise ValueError(
            f"rank {group_rank} is not a rank of the group: its ranks are 0..{size - 1}. Inside "
            "a group, take ranks and sizes from the group: dist.get_rank(group), "
            "dist.get_world_size(group) (without group= they are the whole world's)"
        )
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def reduce_broadcast_all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    root: int = 0,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place through one root: gather-and-reduce, then send back.

    ``root`` is a rank of ``group`` (0 .. group size - 1), not a global rank; ``group=None`` is
    the default group. Bytes sent: (n-1)·S by the root, S by every other rank (S = tensor bytes).
    """
    check_all_reduce_args(tensor, op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if not 0 <= root < world:
        raise ValueError(f"root={root} is outside [0, {world - 1}] (a rank within the group)")
    if world == 1:
        return tensor
    # TODO 1.3: all-reduce `tensor` in place through the root, from point-to-point messages.
    # Invariant: afterwards every rank's tensor holds the same bits: the reduction of all
    #   ranks' inputs taken in group-rank order 0, 1, ..., n-1, whichever rank is the root;
    #   the root sends and receives (n-1)·S bytes, every other rank S; nothing hangs, whatever
    #   the size; only members of `group` talk.
    # Hint 1: what must the root hold before it can send anything back?
    # More hints: uv run python -m tests.hint 1.3
    # See guidelines.md#13-all-reduce-from-send-and-recv
    raise NotImplementedError(
        "TODO 1.3: all-reduce `tensor` in place through the root, from point-to-point messages "
        "(see phase1_data_parallel/guidelines.md#13-all-reduce-from-send-and-recv)"
    )


def direct_exchange_all_reduce(
    tensor: torch.Tensor, op: object = ReduceOp.SUM, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce ``tensor`` in place by sending it to every other rank and reducing locally.

    ``group=None`` is the default group. Bytes sent: (n-1)·S by every rank. One round of
    messages, so latency stays low; volume grows with the world, so it suits small tensors only.
    """
    check_all_reduce_args(tensor, op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return tensor
    # TODO 1.3: all-reduce `tensor` in place, every rank messaging every other rank directly.
    # Invariant: the same bits on every rank: the reduction of all ranks' inputs taken in
    #   group-rank order 0, 1, ..., n-1; every rank sends and receives (n-1)·S bytes, in one
    #   round; nothing hangs, whatever the size; only members of `group` talk.
    # Hint 1: every rank sends n-1 messages and receives n-1: which of those calls may wait
    #   for a peer, and for what? (the guide's "When ranks hang")
    # More hints: uv run python -m tests.hint 1.3
    # See guidelines.md#13-all-reduce-from-send-and-recv
    raise NotImplementedError(
        "TODO 1.3: all-reduce `tensor` in place, every rank messaging every other rank directly "
        "(see phase1_data_parallel/guidelines.md#13-all-reduce-from-send-and-recv)"
    )
