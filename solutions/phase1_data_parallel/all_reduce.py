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
functions (``root``) are ranks *within* the group, 0 .. group size - 1; torch's ``dst=``/``src=``
want *global* ranks, so every peer is mapped with :func:`global_rank` before a message is sent.
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
    # TODO 1.3: reduce every rank's tensor on the root, then send the result back to all ranks.
    # Invariant: afterwards every rank's tensor holds the same bits: the reduction of all
    #   ranks' inputs taken in group-rank order 0, 1, ..., n-1; only members of `group` talk.
    # Hint 1: non-roots send their tensor to the root, then receive the result back into it.
    #   rank, world and root count within the group; send/recv want global ranks (global_rank).
    # Hint 2: the root needs a separate receive buffer per peer, posts all receives before
    #   waiting on any, then folds the n contributions in rank order with combine_, starting
    #   from a copy of contribution 0 (its own tensor sits at position `root`, not first),
    #   writes the result into `tensor` and sends it to each peer. Every message names the
    #   group and a peer mapped to its global rank; a non-root needs just two blocking calls.
    # Hint 3: non-root: a blocking send to the root, then a blocking receive from it into the
    #   same tensor, the root named by its global rank (global_rank) and `group` given. Root:
    #   one irecv per peer into a fresh buffer like the tensor (empty_like), one wait_all; the
    #   result starts as a clone of contribution 0, contributions 1..n-1 are combined into it
    #   with op (combine_), it is copied back into `tensor`, and isent to every peer.
    # See guidelines.md#13-all-reduce-from-send-and-recv
    # >>> solution
    if rank != root:
        dist.send(tensor, dst=global_rank(group, root), group=group)
        dist.recv(tensor, src=global_rank(group, root), group=group)
        return tensor
    buffers = {peer: torch.empty_like(tensor) for peer in range(world) if peer != root}
    wait_all(
        [
            dist.irecv(buf, src=global_rank(group, peer), group=group)
            for peer, buf in buffers.items()
        ]
    )
    contributions = [tensor if peer == root else buffers[peer] for peer in range(world)]
    result = contributions[0].clone()
    for contribution in contributions[1:]:
        combine_(result, contribution, op)
    tensor.copy_(result)
    wait_all([dist.isend(tensor, dst=global_rank(group, peer), group=group) for peer in buffers])
    return tensor
    # <<< solution


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
    # TODO 1.3: exchange tensors with every peer at once, then reduce all n contributions.
    # Invariant: the same bits on every rank, so reduce in group-rank order 0..n-1 everywhere,
    #   your own tensor included at its own position; only members of `group` talk.
    # Hint 1: blocking send/recv pairs in a loop can deadlock (two ranks both sending first);
    #   post every send and receive without waiting, then wait for all of them.
    # Hint 2: one receive buffer per peer; post a send of `tensor` and a receive into the
    #   peer's buffer for every peer (on the group, peers mapped to global ranks), wait for
    #   all of them, and only then reduce: start from a copy of contribution 0 and fold in
    #   1..n-1 with combine_, your own tensor taking its own slot. Do not overwrite `tensor`
    #   before every send has completed: a peer may still be reading it.
    # Hint 3: one list of 2(n-1) works: an isend of `tensor` to each peer and an irecv into
    #   that peer's buffer, each peer by its global rank, on `group`; one wait_all over the
    #   list; then the fold of reduce_broadcast_all_reduce's root (a clone of contribution 0,
    #   contributions 1..n-1 combined into it, copied into `tensor`).
    # See guidelines.md#13-all-reduce-from-send-and-recv
    # >>> solution
    buffers = {peer: torch.empty_like(tensor) for peer in range(world) if peer != rank}
    works = [dist.isend(tensor, dst=global_rank(group, peer), group=group) for peer in buffers]
    works += [
        dist.irecv(buf, src=global_rank(group, peer), group=group) for peer, buf in buffers.items()
    ]
    wait_all(works)
    contributions = [tensor if peer == rank else buffers[peer] for peer in range(world)]
    result = contributions[0].clone()
    for contribution in contributions[1:]:
        combine_(result, contribution, op)
    tensor.copy_(result)
    return tensor
    # <<< solution
