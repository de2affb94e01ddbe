"""Exercise 3.6, extended: ``clip_grad_norm_`` over a model sharded in data, tensor and pipeline.

One process clips by the norm of *all* gradients: ``total = ||(g_1, ..., g_P)||_p`` over every
element of every parameter, then scales every gradient by ``min(1, max_norm / (total + 1e-6))``
(``torch.nn.utils.clip_grad_norm_``). On a sharded model each rank must scale by that same
global ``total``, while it holds only some gradients, some of them also held by other ranks.
Every piece of every gradient must enter that norm, and a copy held by several ranks (replicated
on dp, or on tp; in exercise 4.7 also on cp, on the experts' edp group, or on the two stages of
a tied embedding) exactly once. How, with one number per rank and a few all-reduces, is the
exercise (guidelines.md#gradient-clipping-across-shards); Megatron-LM's ``get_grad_norm_fp32``
(megatron/core/optimizer/clip_grads.py) and torch's ``clip_grad_norm_`` on DTensor gradients
(FSDP2, tensor parallel) solve the same problem. The gradients and where their copies live
come as :class:`GradShard` (clip_placement.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from course.topology import AXES, Topology
from phase3_multi_node.clip_placement import GradShard


def counted_here(shard: GradShard, topology: Topology) -> bool:
    """Whether this rank adds ``shard`` into the global norm: of every set of ranks holding
    identical copies of it, exactly one does."""
    # TODO 3.6: whether this rank's copy of the gradient is the one the norm counts
    # Invariant: over all ranks, every distinct piece of every gradient is counted exactly once:
    #   a tensor replicated on some groups by one rank of each set of copies, decided by every
    #   rank from its own place alone (no message); a tensor held by nobody else by its rank.
    # Hint 1: the copies of a tensor replicated on a group are the ranks of that group of the
    #   topology; topology.rank_in gives this rank's index in its group of a name.
    # Hint 2: Among the copies of a tensor along one group, which single rank could every copy
    #   agree on without a message? With copies along several groups, what must be true of
    #   the counting rank along each of them? And with no copies at all?
    # Hint 3: along one group, every copy knows its own index there, and index 0 exists in
    #   every group: the rank with index 0 counts.
    # Hint 4: along several groups, the counting rank must be that one along every one of
    #   them: index 0 in all of them, not in any one.
    # Hint 5: true when topology.rank_in of every name in shard.replicated_on is 0; with no
    #   name at all, true.
    # See guidelines.md#gradient-clipping-across-shards
    # >>> solution
    return all(topology.rank_in(name) == 0 for name in shard.replicated_on)
    # <<< solution


def global_grad_norm(
    shards: Sequence[GradShard], norm_type: float, topology: Topology
) -> torch.Tensor:
    """The ``norm_type``-norm of the whole model's gradients, the same value on every rank (a
    collective over the topology's groups: call it on every rank). ``norm_type`` is a positive
    number or ``inf``; an fp64 0-dim tensor is returned (fp32 accumulation of millions of
    squares loses digits)."""
    if math.isnan(norm_type) or norm_type <= 0:  # -inf, 0 and negative p included
        raise ValueError(f"norm_type={norm_type}: a positive number or inf")
    device = shards[0].grad.device if shards else torch.device("cpu")
    # TODO 3.6: the global norm, the same on every rank, from this rank's part and the groups
    # Invariant: every rank returns the norm one process would compute over all gradients:
    #   every distinct element enters once, every piece held anywhere contributes; for inf,
    #   the largest |g| anywhere; a float64 0-dim tensor, the gradients left as they are.
    # Hint 1: the groups of the topology's four axes (AXES) together span the world, and a
    #   group of one rank costs nothing.
    # Hint 2: Which groups hold other pieces of the model, and so must contribute? Can the
    #   p-th power of the norm be computed in parts, and how do the parts combine for a finite
    #   p, and for inf? Where is the p-th root taken: on each rank's part, or once? Which
    #   shards enter this rank's part?
    # Hint 3: every axis may hold other pieces (tp shards, pipeline stages, ZeRO slices along
    #   dp or cp): reduce the part over the group of each of the four axes, one after the
    #   other; together they reach every rank once.
    # Hint 4: for a finite p, the p-th power of the norm is a sum over elements: each rank's
    #   part is the sum of |g| to the p over the shards counted_here keeps, in float64; the
    #   parts add (ReduceOp.SUM), and the root, the power 1/p, is taken once, after.
    # Hint 5: for inf, each rank's part is its largest |g| over every shard it holds (a copy
    #   cannot change a max), and the parts combine with ReduceOp.MAX; no root.
    # Hint 6: a 0-dim float64 part on the gradients' device; fill it as above; one all-reduce
    #   of it on topology.group of each name in AXES, SUM or MAX; then, for a finite p, its
    #   power 1/p.
    # See guidelines.md#gradient-clipping-across-shards
    # >>> solution
    partial = torch.zeros((), dtype=torch.float64, device=device)
    if math.isinf(norm_type):
        for shard in shards:  # copies cannot change a max: every shard takes part
            if shard.grad.numel():
                partial = torch.maximum(partial, shard.grad.detach().abs().max().double())
        op = dist.ReduceOp.MAX
    else:
        for shard in shards:
            if counted_here(shard, topology):
                partial += shard.grad.detach().double().abs().pow(norm_type).sum()
        op = dist.ReduceOp.SUM
    # the four axes' groups together span the world: tp pieces, cp and dp copies or slices,
    # pipeline stages (a group of one rank when the axis has degree 1)
    for axis in AXES:
        dist.all_reduce(partial, op=op, group=topology.group(axis))
    return partial if math.isinf(norm_type) else partial ** (1.0 / norm_type)
    # <<< solution


def clip_grad_norm_(
    shards: Sequence[GradShard],
    max_norm: float,
    norm_type: float,
    topology: Topology,
) -> torch.Tensor:
    """Scale every gradient in ``shards`` in place so that the global norm is at most
    ``max_norm``, exactly as ``torch.nn.utils.clip_grad_norm_`` does on one process holding the
    whole model (``max_norm / (total + 1e-6)``, clamped to 1, multiplied into every gradient);
    returns the global norm before clipping (the same on every rank). A collective."""
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm}: a positive bound")
    total = global_grad_norm(shards, norm_type, topology)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for shard in shards:
        shard.grad.mul_(scale.to(shard.grad.dtype))
    return total
