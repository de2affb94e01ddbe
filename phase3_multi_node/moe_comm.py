"""Given for exercise 3.8: the records the MoE functions pass around, the routing census, the
capacity number, and an all-to-all that autograd can differentiate.

* :class:`Routing` (what the router decided for this rank's tokens), :class:`DispatchPlan`
  (what dispatch did, so that combine can undo it) and :class:`MoEStep` (all of one forward,
  for reports): plain records, the fields documented.
* :func:`count_choices` and :func:`gather_expert_counts`: how many of the token choices of each
  rank of the expert-parallel group went to each expert: one small all-gather of ``num_experts``
  integers per rank (the "census"). The capacity rule needs it: an expert's capacity is shared by
  every rank that sends to it.
* :func:`expert_capacity`: how many token choices one expert takes, at most (Switch Transformer's
  expert capacity, Fedus et al. 2021, section 2.2; Megatron-LM's ``get_capacity``).
* :func:`all_to_all`: ``dist.all_to_all_single`` with uneven splits as an autograd Function. The
  forward sends ``send_splits[j]`` rows to group rank j and receives ``recv_splits[j]`` from it;
  its backward is the same exchange reversed (the gradient of a row goes back to the rank the
  row came from: swap the splits), exactly as torch's own differentiable versions do
  (``torch.distributed.nn.functional.all_to_all_single``, and
  ``torch.distributed._functional_collectives.all_to_all_single_autograd`` used by torchtitan).
  Written out here so that a reader sees the whole of it and the tests can count its calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None


class Routing(NamedTuple):
    """The router's decision for ``T`` tokens.

    ``experts`` (T, k) int64: the k experts of each token, the most probable first;
    ``weights`` (T, k): the weight of each choice in the token's output;
    ``probs`` (T, num_experts): the router's probability of every expert for every token.
    """

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor


@dataclass(frozen=True)
class DispatchPlan:
    """What :func:`dispatch` did with this rank's token choices, for :func:`combine` to undo.

    ``order`` (int64, one entry per row sent): the token choices that were sent, as positions in
    the flattened (T, k) choices (token t's choice j is ``t * k + j``), in the order their rows
    were sent; choices that were dropped do not appear.
    ``send_splits[j]`` / ``recv_splits[j]``: rows sent to / received from group rank j.
    ``recv_counts`` (ep, experts per rank), int64: rows received from each rank for each of this
    rank's experts (what :class:`~phase3_multi_node.moe_experts.LocalExperts` needs).
    ``num_tokens`` (T) and ``k``: the shape of this rank's choices.
    """

    order: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    recv_counts: torch.Tensor
    num_tokens: int
    k: int


@dataclass(frozen=True)
class MoEStep:
    """What one forward of an MoE layer decided on this rank (kept for reports and tests):
    the :class:`Routing`, the ``keep`` mask (T, k), the ``census`` (ep, num_experts), the
    ``capacity`` per expert and the :class:`DispatchPlan`."""

    routing: Routing
    keep: torch.Tensor
    census: torch.Tensor
    capacity: int
    plan: DispatchPlan


def group_rank_and_size(group: Group = None) -> tuple[int, int]:
    """This rank's index in ``group`` and the group's size (None: the whole world)."""
    return dist.get_rank(group), dist.get_world_size(group)


def count_choices(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the choices in ``experts`` (any shape, expert indices) name each expert:
    int64, shape (num_experts,)."""
    return torch.bincount(experts.flatten().long(), minlength=num_experts)


def gather_expert_counts(
    experts: torch.Tensor, num_experts: int, group: Group = None
) -> torch.Tensor:
    """The census: ``census[r, e]`` = how many token choices of group rank r went to expert e
    (before any is dropped). One all-gather of ``num_experts`` int64 per rank on ``group``;
    every rank of the group gets the same (ep, num_experts) tensor."""
    _, size = group_rank_and_size(group)
    local = count_choices(experts, num_experts).to(experts.device)
    census = torch.empty(size * num_experts, dtype=torch.long, device=experts.device)
    dist.all_gather_into_tensor(census, local, group=group)
    return census.view(size, num_experts)


def expert_capacity(census: torch.Tensor, k: int, capacity_factor: float) -> int:
    """The most token choices one expert takes in this step: ``capacity_factor`` times the fair
    share, rounded up, where the fair share is the group's token choices (T tokens x k) spread
    evenly over the experts. 1.0 leaves no slack: any imbalance drops choices; Switch
    Transformer trains with 1.0-1.25 (Fedus et al. 2021, section 2.2 and table 1)."""
    if k < 1 or not math.isfinite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(f"k={k}, capacity_factor={capacity_factor}: need k >= 1 and a factor > 0")
    num_experts = census.shape[-1]
    choices = int(census.sum())
    fair_share = choices / num_experts
    # the small margin keeps 1.1 * 30 = 33.000000000000004 from rounding up to 34
    return max(0, math.ceil(capacity_factor * fair_share - 1e-9))


def _check_splits(tensor: torch.Tensor, send: list[int], recv: list[int], size: int) -> None:
    for name, splits in (("send_splits", send), ("recv_splits", recv)):
        if len(splits) != size or any(int(s) != s or s < 0 for s in splits):
            raise ValueError(
                f"{name}={splits}: need one whole number >= 0 per rank of the group ({size})"
            )
    if sum(send) != tensor.shape[0]:
        raise ValueError(
            f"send_splits={send} add up to {sum(send)} rows but the tensor has {tensor.shape[0]}: "
            "the splits cut the tensor's first dimension into the rows for each rank, in order"
        )


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward: the same exchange, splits swapped."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Group
    ) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        rows = tensor.contiguous()
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows, recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # The row this rank received from rank j has its gradient here; it belongs to rank j.
        back = AllToAll.apply(grad.contiguous(), ctx.recv_splits, ctx.send_splits, ctx.group)
        return back, None, None, None


def all_to_all(
    tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Group = None
) -> torch.Tensor:
    """Send the first ``send_splits[0]`` rows of ``tensor`` to group rank 0, the next
    ``send_splits[1]`` to rank 1, ...; return the rows received, ``recv_splits[j]`` from rank j,
    in rank order. Differentiable: the gradient of the result flows back to ``tensor`` through
    the reverse exchange. Every rank of ``group`` must call it, and what rank i sends to rank j
    must be what rank j expects from rank i (nobody can check that for you: a wrong count
    fails inside the collective, or hangs)."""
    send = [int(s) for s in send_splits]
    recv = [int(s) for s in recv_splits]
    _check_splits(tensor, send, recv, dist.get_world_size(group))
    out: torch.Tensor = AllToAll.apply(tensor, send, recv, group)
    return out
