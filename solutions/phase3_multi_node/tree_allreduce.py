"""Exercise 3.2 (first part): halving-doubling all-reduce (Rabenseifner's algorithm), any world.

With p = 2^k ranks, the **reduce-scatter by recursive halving** takes k steps. At the step with
distance d (p/2, p/4, ..., 1), rank r pairs with ``r XOR d``, both split the range they are
responsible for in two halves, the lower rank of the pair keeps the lower half, and each sends
the half it gives up and reduces the half it keeps with the partner's copy of it. After k steps
rank r holds block r (1/p of the tensor) fully reduced. The **all-gather by recursive doubling**
replays the steps backwards (d = 1, 2, ..., p/2), each pair exchanging the blocks it holds, so
the owned range doubles each step. Each rank sends S/2 + S/4 + ... = (p-1)/p·S per phase,
2(p-1)/p·S in all, the ring's volume, in 2·log2(p) messages instead of 2(p-1): the bandwidth of
the ring with the latency of a tree (R. Rabenseifner, "Optimization of collective reduction
operations", ICCS 2004; Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 19(1), 2005, section 4.4). MPICH picks it for long messages; NCCL's
``NCCL_ALGO=Tree`` is a different tree (a pipelined double binary tree), also logarithmic.

**Not a power of two.** With n = p + e ranks (p the largest power of two <= n), the standard
fold-in (Thakur et al. 2005): among the first 2e ranks, each even rank sends its whole tensor to
the odd rank after it and sits out; the odd ranks reduce, and they and the ranks from 2e on take
new ranks 0..p-1 (``r // 2`` for an odd r < 2e, ``r - e`` from 2e on) for the power-of-two
algorithm; at the end each odd rank sends the result back to its even partner. The e extra pairs
pay 2·(alpha + beta·S) more; the folded ranks send S and receive S.

Every block is reduced by exactly one rank and then copied, so every rank ends with the same bits.
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
)

_POOL = BufferPool()


def largest_power_of_two(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"n={n}: a group has at least one rank")
    return 1 << (n.bit_length() - 1)


def fold_role(rank: int, n: int) -> tuple[str, int]:
    """This rank's part in the fold-in, and its rank among the p = 2^k that run the core.

    ``("folded", partner)``: an even rank below 2e; it sends its tensor to ``partner`` (rank + 1)
    and gets the result back. ``("core", new_rank)``: it runs the power-of-two algorithm as
    ``new_rank``. ``core_rank_to_group`` below maps a new rank back.
    """
    extra = n - largest_power_of_two(n)
    if rank < 2 * extra:
        return ("folded", rank + 1) if rank % 2 == 0 else ("core", rank // 2)
    return "core", rank - extra


def core_rank_to_group(new_rank: int, n: int) -> int:
    """The group rank that plays ``new_rank`` in the power-of-two core (inverse of fold_role)."""
    extra = n - largest_power_of_two(n)
    return 2 * new_rank + 1 if new_rank < extra else new_rank + extra


def exchange(
    outgoing: torch.Tensor, incoming: torch.Tensor, partner: int, group: dist.ProcessGroup
) -> None:
    """Send ``outgoing`` to and receive ``incoming`` from global rank ``partner``, at once.

    Both are posted before either is waited on, so two partners exchanging never deadlock; an
    empty side is skipped (both partners know the sizes, so they skip the same message).
    """
    works = []
    if incoming.numel():  # the receive first: the partner's data can land as soon as it is sent
        works.append(dist.irecv(incoming, src=partner, group=group))
    if outgoing.numel():
        works.append(dist.isend(outgoing, dst=partner, group=group))
    for work in works:
        if work is not None:
            work.wait()


def halving_doubling_all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` by recursive halving, then doubling.

    Any group size (the extra ranks of a non-power-of-two group fold in), any size, SUM,
    PRODUCT, MIN, MAX. Returns ``tensor``. Bytes sent per rank: (p-1)/p·S in each phase for the
    p core ranks (up to rounding of the halves), plus S for each rank of a fold-in pair.
    """
    check_reduce_args(tensor, op)
    group, rank, n = group_and_size(group)
    flat = tensor.view(-1)
    if n == 1 or flat.numel() == 0:
        return tensor
    p = largest_power_of_two(n)
    role, me = fold_role(rank, n)
    # TODO 3.2: fold the extra ranks in: even ranks below 2e hand their tensor to rank + 1.
    # Invariant: afterwards the p core ranks hold every rank's contribution between them (an
    #   odd rank below 2e holds its partner's combined with its own); a folded rank waits for
    #   the result and returns.
    # Hint 1: with n = 6, p = 4 and e = 2: rank 0 sends to 1, rank 2 sends to 3; then ranks
    #   1, 3, 4, 5 run the power-of-two algorithm as 0, 1, 2, 3.
    # Hint 2: a folded rank sends its whole tensor to its partner, then receives the final
    #   result back into it, and is done (blocking calls are safe: the partner receives first).
    #   Its partner receives that tensor into a separate buffer and combines it into its own.
    #   Every peer is a group rank to map to a global one.
    # Hint 3: a folded rank: a blocking dist.send of the flat tensor to its partner (`me`
    #   names it; peer maps it to a global rank, with group given), then a blocking dist.recv
    #   from the same partner into the same tensor. An odd rank below 2e: a dist.recv from
    #   group rank rank − 1 into a pooled buffer, then combine_ of that buffer into flat.
    # See guidelines.md#32-halving-doubling-and-the-alpha-beta-model
    # >>> solution
    if role == "folded":
        dist.send(flat, dst=peer(group, me), group=group)
        dist.recv(flat, src=peer(group, me), group=group)
        return tensor
    extra = n - p
    if rank < 2 * extra:
        incoming = _POOL.get(flat.numel(), flat)
        dist.recv(incoming, src=peer(group, rank - 1), group=group)
        combine_(flat, incoming, op)
    # <<< solution
    # TODO 3.2: recursive halving, then recursive doubling, among the p core ranks.
    # Invariant: at the halving step of distance d (p/2, p/4, ..., 1) core rank me pairs with
    #   me ^ d; the lower of the two keeps the lower half of the current range [lo, hi), sends
    #   the other half and reduces what it receives into the kept half. After the last step
    #   [lo, hi) is block me, reduced; doubling replays the pairs in reverse, exchanging ranges.
    # Hint 1: both ranks of a pair must split [lo, hi) at the same middle, rounded the same way,
    #   or sizes that do not divide by p leave elements out. Remember each step's ranges:
    #   doubling needs them back.
    # Hint 2: the partner is a core rank: map it back to its group rank (core_rank_to_group),
    #   then to a global one. Halving, per step: split at mid, decide which half you keep,
    #   exchange (send the half you give, receive the partner's copy of the half you keep into
    #   a buffer), reduce it into the kept half, remember the step. Doubling: the steps in
    #   reverse, sending what you hold and receiving the half you gave into place. At the end
    #   an odd rank below 2e sends the result back to its folded partner.
    # Hint 3: the partner is core rank me XOR d, mapped by core_rank_to_group then peer; the
    #   lower of the pair is the one whose bit d is 0 (me AND d = 0). Halving: exchange sends
    #   flat's `give` range and receives into a buffer, then combine_ reduces the buffer into
    #   flat's `keep` range. Doubling: exchange sends flat's `keep` range and receives straight
    #   into flat's `give` range.
    # See guidelines.md#32-halving-doubling-and-the-alpha-beta-model
    # >>> solution
    lo, hi = 0, flat.numel()
    history: list[tuple[int, tuple[int, int], tuple[int, int]]] = []
    distance = p // 2
    while distance >= 1:
        partner = peer(group, core_rank_to_group(me ^ distance, n))
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if me & distance == 0 else ((mid, hi), (lo, mid))
        incoming = _POOL.get(keep[1] - keep[0], flat)
        exchange(flat[give[0] : give[1]], incoming, partner, group)
        combine_(flat[keep[0] : keep[1]], incoming, op)
        history.append((partner, keep, give))
        lo, hi = keep
        distance //= 2
    for partner, keep, give in reversed(history):
        exchange(flat[keep[0] : keep[1]], flat[give[0] : give[1]], partner, group)
    if rank < 2 * extra:
        dist.send(flat, dst=peer(group, rank - 1), group=group)
    # <<< solution
    return tensor
