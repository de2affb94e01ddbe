"""Exercise 3.2 (first part): halving-doubling all-reduce (Rabenseifner's algorithm), any world.

With p = 2^k ranks, the **reduce-scatter by recursive halving** takes k steps. At each step the
ranks pair up; the two ranks of a pair are responsible for the same range, split it in two
halves, and each sends the half it gives up and reduces the half it keeps with the partner's
copy of it. After k steps each rank holds 1/p of the tensor fully reduced. The **all-gather by
recursive doubling** undoes the halving's steps, each pair exchanging what it holds, so the held
range doubles each step. Each rank sends S/2 + S/4 + ... = (p-1)/p·S per phase,
2(p-1)/p·S in all, the ring's volume, in 2·log2(p) messages instead of 2(p-1): the bandwidth of
the ring with the latency of a tree (R. Rabenseifner, "Optimization of collective reduction
operations", ICCS 2004; Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 19(1), 2005, section 4.4). MPICH picks it for long messages; NCCL's
``NCCL_ALGO=Tree`` is a different tree (a pipelined double binary tree), also logarithmic.

**Not a power of two.** With n = p + e ranks (p the largest power of two <= n), the standard
fold-in (Thakur et al. 2005): among the first 2e ranks, each even rank is folded into the odd
rank after it and sits the power-of-two algorithm out; the others take new ranks 0..p-1 (the
*core ranks*: ``fold_role`` and ``core_rank_to_group`` below) for the power-of-two algorithm. The
e extra pairs pay 2·(alpha + beta·S) more; the folded ranks send S and receive S.

Every rank must end with the same bits (guidelines.md#32-halving-doubling-and-the-alpha-beta-model
has the contract and the questions whose answers are the design).
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
    # TODO 3.2: fold the extra ranks in, so that p core ranks hold every rank's contribution
    # Invariant: afterwards the p core ranks hold every rank's contribution between them, each
    #   once; a folded rank ends holding the group's result, like every other rank.
    # Hint 1: fold_role says which role this rank plays; with n = 6, ranks 0 and 2 are folded
    #   and ranks 1, 3, 4, 5 are the core ranks 0, 1, 2, 3.
    # Hint 2: What does a folded rank hand over, and to whom? Where does its partner put what
    #   it receives, given that its own tensor still holds its own term? What does a folded
    #   rank do while the core runs, and from whom does it get the result?
    # Hint 3: a folded rank sends its whole tensor to its partner; the partner (an odd rank
    #   below 2e, whose left neighbour is the folded one) receives it into a separate pooled
    #   buffer and combines it into its own tensor. Blocking calls are safe here: the two wait
    #   for each other only.
    # Hint 4: the folded rank has nothing to do in the core: right after sending, it receives
    #   the result from the same partner into its own tensor and returns. (Its partner's side
    #   of that message comes at the end of the next TODO.)
    # Hint 5: folded: a blocking send of the flat tensor to the partner fold_role named, then a
    #   blocking receive from it into the flat tensor, then return. An odd rank below 2e: a
    #   blocking receive from the group rank just below it into a pooled buffer, combined into
    #   the flat tensor. Every peer goes through peer to become a global rank.
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
    # TODO 3.2: halving, then doubling, among the p core ranks; then the folded ranks' result
    # Invariant: every rank of the group ends with the same bits, the group's reduction: each
    #   element reduced once, by one rank, then copied; a core rank sends 2(p-1)/p·S in
    #   2·log2(p) messages; every message goes to a rank of the group, named by global rank.
    # Hint 1: at the step of distance d (p/2, p/4, ..., 1) a rank pairs with the core rank d
    #   away from its own, up or down: which one keeps both responsible for the same range?
    # Hint 2: Which core rank is me's partner at distance d, and which rank numbers do the
    #   destination and source of a message want? Which half does each of the two keep, and
    #   where do both split a range of odd length? What must a rank remember from each
    #   halving step, and in which order does doubling replay the steps? Who still waits for
    #   the result when doubling is over?
    # Hint 3: the partner's core rank is me with the bit of value d flipped (an exclusive or);
    #   core_rank_to_group, then peer, turn it into the global rank a message wants. Check on
    #   p = 8: core rank 5 pairs with 1, then 7, then 4.
    # Hint 4: both split the current range at the integer middle, rounded down, so their halves
    #   agree; the rank whose bit d is 0 keeps the lower half. Each step's partner, kept range
    #   and given range go on a list; doubling walks that list backwards, from d = 1 up.
    # Hint 5: halving, per step: exchange sends the given range and receives the partner's copy
    #   of the kept range into a pooled buffer; combine_ reduces it into the kept range, and
    #   the kept range becomes the current one. Doubling, per remembered step in reverse: send
    #   the kept range (final now) and receive straight into the given range. Last, an odd rank
    #   below 2e sends the whole result to the folded rank just below it.
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
