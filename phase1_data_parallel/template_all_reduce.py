# Exercise template generated from solutions/phase1_data_parallel/all_reduce.py.
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


def reduce_broadcast_all_reduce(
    tensor: torch.Tensor, op: object = ReduceOp.SUM, root: int = 0
) -> torch.Tensor:
    """All-reduce ``tensor`` in place through one root: gather-and-reduce, then send back.

    Bytes sent: (n-1)·S by the root, S by every other rank (S = tensor bytes).
    """
    check_all_reduce_args(tensor, op)
    rank, world = dist.get_rank(), dist.get_world_size()
    if not 0 <= root < world:
        raise ValueError(f"root={root} is outside [0, {world - 1}]")
    if world == 1:
        return tensor
    # TODO 1.3: reduce every rank's tensor on the root, then send the result back to all ranks.
    # Invariant: afterwards every rank's tensor holds the same bits: the reduction of all
    #   ranks' inputs taken in rank order 0, 1, ..., n-1.
    # Hint 1: non-roots send their tensor to the root, then receive the result into `tensor`.
    #   The root posts one irecv per peer (each into its own buffer), waits for them, then
    #   reduces in rank order with combine_ and isends the result to every peer.
    # Hint 2: on the root: bufs = {r: torch.empty_like(tensor) for r != root};
    #   wait_all([dist.irecv(bufs[r], src=r) ...]); result = first contribution.clone();
    #   combine_(result, next contribution, op) ...; tensor.copy_(result); isend to each peer.
    #   Elsewhere: dist.send(tensor, dst=root); dist.recv(tensor, src=root).
    # See guidelines.md#13-all-reduce-from-send-and-recv
    raise NotImplementedError(
        "TODO 1.3: reduce every rank's tensor on the root, then send the result back to all ranks "
        "(see phase1_data_parallel/guidelines.md#13-all-reduce-from-send-and-recv)"
    )


def direct_exchange_all_reduce(tensor: torch.Tensor, op: object = ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``tensor`` in place by sending it to every other rank and reducing locally.

    Bytes sent: (n-1)·S by every rank. One round of messages, so latency stays low; volume grows
    with the world, so it suits small tensors only.
    """
    check_all_reduce_args(tensor, op)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return tensor
    # TODO 1.3: exchange tensors with every peer at once, then reduce all n contributions.
    # Invariant: the same bits on every rank, so reduce in rank order 0..n-1 everywhere,
    #   your own tensor included at its own position.
    # Hint 1: blocking send/recv pairs in a loop can deadlock (two ranks both sending first);
    #   post all isends and irecvs, then wait for all of them.
    # Hint 2: bufs = {p: torch.empty_like(tensor) for p != rank}; works = isend(tensor, dst=p)
    #   and irecv(bufs[p], src=p) for every peer p; wait_all(works);
    #   result = clone of contribution 0; combine_ the rest in rank order; tensor.copy_(result).
    # See guidelines.md#13-all-reduce-from-send-and-recv
    raise NotImplementedError(
        "TODO 1.3: exchange tensors with every peer at once, then reduce all n contributions "
        "(see phase1_data_parallel/guidelines.md#13-all-reduce-from-send-and-recv)"
    )
