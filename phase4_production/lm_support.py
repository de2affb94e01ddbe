"""Given helpers of exercise 4.7: the gradients a rank holds, flat reductions, the balance loss's
way into backward, and the refusals of shapes that do not split.

Not an exercise. ``template_lm_parallel.py`` and ``template_lm_sequence_parallel.py`` use:

* :class:`HeldGradient`: one gradient this rank holds after the pipeline's step, with the facts
  that decide its reductions and its place in the global norm (which weights are whole on every
  tp rank, which is a copy of a tied embedding, which belongs to an expert, which ZeRO has
  averaged already);
* :func:`all_reduce_flat`: one all-reduce per dtype for a list of tensors (one message latency
  instead of one per tensor, as phase 1's gradient averaging), results copied back in place;
* :func:`check_sequence_share`: refuse a sequence that does not split into equal shares.

The runtime (``lm_runtime.py``) uses :class:`AttachLoss`, which lets a loss computed in the
middle of a pipeline stage (the MoE balance loss) take part in that stage's backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None
AllReduceFn = Callable[..., Any]


@dataclass(frozen=True)
class HeldGradient:
    """One gradient this rank holds, and what kind of weight it belongs to.

    ``name``: the one-process model's parameter name (``blocks.2.mlp_norm.weight``).
    ``grad``: the tensor to reduce and clip in place: the whole gradient of this rank's piece of
        the weight (its tensor-parallel shard, its experts), or, under ZeRO/FSDP, this rank's
        slice of that piece's flat gradient.
    ``tp_replicated``: the weight is whole on every rank of the tp group (norms, embedding, head,
        the MoE router and experts); the column- and row-parallel shards are not.
    ``tied``: this is one of the two copies of a tied embedding (the embedding on the first
        pipeline stage, the head on the last), and the other copy lives on another rank.
    ``expert``: the weight belongs to one expert of an MoE layer (held by one rank of each ep
        group).
    ``reduced``: ZeRO (or FSDP) has already averaged it over the data x context ranks (during
        backward; under ZeRO-1 the runtime's reduce-scatter after it), and ``grad`` is this
        rank's slice.
    """

    name: str
    grad: torch.Tensor
    tp_replicated: bool = False
    tied: bool = False
    expert: bool = False
    reduced: bool = False


def all_reduce_flat(
    tensors: Sequence[torch.Tensor],
    group: Group,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    all_reduce_fn: AllReduceFn | None = None,
) -> None:
    """All-reduce ``tensors`` in place with one collective per dtype: flattened into one buffer,
    reduced on ``group``, copied back. Every rank of the group must pass tensors of the same
    shapes, dtypes and order. ``all_reduce_fn(buffer, group=group)`` replaces
    ``dist.all_reduce`` (a hand-made ring, say); it sums and nothing else, so another ``op``
    with it is refused (ValueError) before anything is sent. Nothing is sent for an empty list
    or a group of one rank."""
    if all_reduce_fn is not None and op != dist.ReduceOp.SUM:
        raise ValueError(
            f"all_reduce_flat(..., op={op}, all_reduce_fn=...): the given all_reduce_fn (a "
            "hand-made all-reduce: 3.1's ring, 3.2's halving-doubling) only sums, so it cannot "
            f"do {op}. For a mean, sum with it (op=SUM, the default) and divide afterwards; for "
            "another op, leave all_reduce_fn out and torch's all-reduce does it"
        )
    if not tensors or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        if all_reduce_fn is not None:
            all_reduce_fn(flat, group=group)
        else:
            dist.all_reduce(flat, op=op, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def check_sequence_share(length: int, ranks: int) -> None:
    """Refuse a sequence of ``length`` tokens that does not cut into ``ranks`` equal,
    contiguous shares (sequence parallelism over a tp group of that size)."""
    if ranks < 1 or length % ranks:
        raise ValueError(
            f"a sequence of {length} tokens does not cut into {ranks} equal shares: sequence "
            f"parallelism gives every tp rank length/tp tokens; use a local sequence length "
            f"that is a multiple of {ranks} (seq_len divisible by 2 x cp x tp)"
        )


def sequence_share(x: torch.Tensor, rank: int, ranks: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of ``x`` along ``dim`` (a view): under sequence
    parallelism the tokens a tp rank embeds and scores itself."""
    check_sequence_share(x.shape[dim], ranks)
    return x.chunk(ranks, dim=dim)[rank]


class AttachLoss(torch.autograd.Function):
    """Identity on ``x`` in forward; in backward, also starts ``loss``'s own backward (its
    gradient is 1). A loss computed in the middle of a pipeline stage (an MoE layer's balance
    loss) thus joins the backward that the stage's output starts, once per micro-batch, on the
    rank that computed it: Megatron-LM's ``MoEAuxLossAutoScaler`` does the same."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)
