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
    # Hint 2: Where does each incoming tensor land on the root: can it receive into `tensor`
    #   itself, or two messages into one buffer? In which order are the n contributions
    #   combined, and where does the root's own sit when the root is rank 3 of 4? Which rank
    #   numbers do torch's dst and src take inside the group (2, 3)?
    # Hint 3: One receive buffer per peer, shaped like the tensor (torch.empty_like), apart
    #   from the root's own tensor: with 4 ranks and root 3, the root holds its own tensor and
    #   three buffers, one each for ranks 0, 1 and 2.
    # Hint 4: The fold starts from a copy of rank 0's contribution and combines ranks 1, 2, ...
    #   into it in turn (combine_); with root 3 of 4 the root's own tensor comes last, not
    #   first. The result is copied into `tensor` before anything is sent back.
    # Hint 5: The answer in words: a non-root sends its tensor to the root and then receives
    #   the result into the same tensor, two blocking calls, the root named by global_rank and
    #   the group given. The root posts one irecv per peer into that peer's buffer, waits for
    #   them all (wait_all), folds the contributions in group-rank order into a clone of the
    #   first, copies the result into `tensor`, and isends it to every peer, waiting for those
    #   sends before it returns.
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
    # TODO 1.3: all-reduce `tensor` in place, every rank messaging every other rank directly.
    # Invariant: the same bits on every rank: the reduction of all ranks' inputs taken in
    #   group-rank order 0, 1, ..., n-1; every rank sends and receives (n-1)·S bytes, in one
    #   round; nothing hangs, whatever the size; only members of `group` talk.
    # Hint 1: every rank sends n-1 messages and receives n-1: which of those calls may wait
    #   for a peer, and for what? (the guide's "When ranks hang")
    # Hint 2: In which order does a rank post its messages and wait for them, so that no two
    #   ranks each wait for the other to receive first? Where does each incoming tensor land?
    #   Where does this rank's own tensor sit in the fold? When may the result be written into
    #   `tensor`, given that a peer may still be reading it?
    # Hint 3: Nothing waits until everything is posted: every send and every receive as an
    #   isend or irecv, 2(n-1) messages with 4 ranks making 6, and only then one wait for all
    #   of them (wait_all).
    # Hint 4: The fold is the root's fold of reduce_broadcast_all_reduce: rank 0's contribution
    #   first, this rank's own tensor at its own position (rank 2 of 4: third). The result
    #   goes into `tensor` only once every send of it has completed.
    # Hint 5: The answer in words: one buffer per peer (torch.empty_like); an isend of `tensor`
    #   to each peer and an irecv into each peer's buffer, peers named by global_rank, on the
    #   group; one wait_all over all of them; then a clone of contribution 0, contributions 1
    #   to n-1 combined into it in turn (this rank's own tensor at its position), copied into
    #   `tensor`.
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
