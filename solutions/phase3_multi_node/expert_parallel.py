"""Exercise 3.8, part 2: expert parallelism: the experts spread over ranks, tokens sent to them.

With E experts on an expert-parallel group of ep ranks, each rank holds E/ep experts (group rank
j the contiguous block ``experts_of_rank(E, ep, j)``) and routes its own tokens; a token's row
must travel to the rank of each expert it chose, be transformed there, and come back (Lepikhin et
al., "GShard", 2020, section 3; Fedus et al., "Switch Transformers", 2022, section 2.2)::

    rank 0 tokens t0 t1 t2    route, keep    dispatch                  rank 0: experts 0, 1
                 |  |  |     ------------->  ------------------->      rank 1: experts 2, 3
    rank 1 tokens t3 t4                                                run the local experts
                                             combine
    rank 0 output y0 y1 y2   <-------------  <-------------------

* :func:`dispatch`: every kept choice's row to the rank that holds its expert (the routing is
  uneven and changes every step);
* :func:`combine`: every expert output back to its token, mixed by the routing's weights;
* :class:`MoELayer`: the layer itself (given), routing and capacity from part 1
  (``moe_routing``), the experts from ``moe_experts.LocalExperts``;
* :func:`sync_moe_gradients`: with ``dp`` replicas of the expert-parallel group
  (``moe_layout.ExpertLayout``), each gradient made that of the mean of every rank's loss.

The tokens, the router and the experts all learn through dispatch and combine. Every function
takes the expert-parallel ``group`` and communicates inside it only.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from phase3_multi_node.moe_comm import (
    DispatchPlan,
    Group,
    MoEStep,
    all_to_all,
    count_choices,
    expert_capacity,
    gather_expert_counts,
    group_rank_and_size,
)
from phase3_multi_node.moe_experts import (
    DenseMoE,
    LocalExperts,
    check_moe_config,
    experts_of_rank,
)
from phase3_multi_node.moe_layout import ExpertLayout
from solutions.phase3_multi_node.moe_routing import (
    keep_within_capacity,
    load_balancing_loss,
    route,
)


def dispatch(
    tokens: torch.Tensor,
    experts: torch.Tensor,
    keep: torch.Tensor,
    num_experts: int,
    group: Group = None,
) -> tuple[torch.Tensor, DispatchPlan]:
    """Send the row of every kept token choice to the rank that holds its expert.

    ``tokens`` (T, hidden): this rank's tokens; ``experts`` (T, k): their experts
    (``Routing.experts``); ``keep`` (T, k) bool: the choices their experts accept
    (``keep_within_capacity``). Returns the rows this rank received, grouped by sender (group
    rank 0's rows first) and, inside each sender's block, by this rank's experts in order (what
    ``LocalExperts`` expects), and the :class:`~phase3_multi_node.moe_comm.DispatchPlan` that
    :func:`combine` needs. The received rows are differentiable in ``tokens``.
    """
    _, ep = group_rank_and_size(group)
    if experts.shape != keep.shape or experts.dim() != 2 or tokens.shape[0] != experts.shape[0]:
        raise ValueError(
            f"tokens {tuple(tokens.shape)}, experts {tuple(experts.shape)}, keep "
            f"{tuple(keep.shape)}: expected (T, hidden), (T, k) and (T, k) for the same T tokens"
        )
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} does not divide over a group of {ep} ranks")
    # TODO 3.8: every kept choice's row to the rank of its expert, and the plan to undo it.
    # Invariant: a token with two kept choices is sent twice (once to each expert), a dropped choice
    #   not at all; every rank receives the rows meant for it grouped by sender and, inside each
    #   sender's block, by its own experts in order; the received rows are differentiable in tokens;
    #   the plan records which choice each sent row was and the rows per rank each way; the routing
    #   is uneven: never assume equal splits.
    # Hint 1: experts sit on ranks in contiguous blocks, so an order of the kept choices by expert
    #   is also an order by destination rank.
    # Hint 2: Before any row moves, each receiver must size its buffer and its splits: who knows how
    #   many rows rank j sends to this rank's expert e, and how does the receiver learn it (every
    #   rank taking part)? In what order must the rows leave, so that they arrive grouped by expert?
    #   What travels for a dropped choice? Which given function moves rows so that the tokens get
    #   their gradient back?
    # Hint 3: The order: the positions, in the flattened (T, k) choices, of the kept choices, sorted
    #   by expert with a stable sort (each expert's in token order), the dropped ones left out; for
    #   instance give every dropped choice the key num_experts, past every real expert, and keep the
    #   first `kept` positions of the sort.
    # Hint 4: The counts: count_choices of the kept choices (E numbers), E/ep of which belong to
    #   each destination rank; one dist.all_to_all_single of equal pieces on the group hands every
    #   rank, from each sender, the counts for its own experts: an (ep, E/ep) table once viewed so.
    # Hint 5: The splits: to rank j goes the sum of the counts of rank j's experts; from rank j
    #   comes the sum of the received table's row for j. Flat choice i belongs to token i divided by
    #   k, rounded down.
    # Hint 6: The rows: the tokens of the choices in that order, selected from tokens (nothing
    #   detached), moved by the given all_to_all with the two splits on the group; return what
    #   arrives and a DispatchPlan of the order, both splits, the received table, T and k.
    # See guidelines.md#38-expert-parallelism
    # >>> solution
    num_tokens, k = experts.shape
    flat_experts = experts.flatten()
    flat_keep = keep.flatten()
    kept = int(flat_keep.sum())
    # Dropped choices get the key num_experts, past every real expert, and are cut off.
    sort_key = torch.where(flat_keep, flat_experts, torch.full_like(flat_experts, num_experts))
    order = torch.argsort(sort_key, stable=True)[:kept]
    send_counts = count_choices(flat_experts[flat_keep], num_experts)
    recv_counts = torch.empty_like(send_counts)
    # Equal pieces of E/ep counts: rank j gets every rank's counts for its own experts.
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    per_rank = num_experts // ep
    recv_table = recv_counts.view(ep, per_rank)
    send_splits = send_counts.view(ep, per_rank).sum(dim=1).tolist()
    recv_splits = recv_table.sum(dim=1).tolist()
    rows = tokens.index_select(0, order // k)
    received = all_to_all(rows, send_splits, recv_splits, group)
    return received, DispatchPlan(order, send_splits, recv_splits, recv_table, num_tokens, k)
    # <<< solution


def combine(
    expert_out: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor, group: Group = None
) -> torch.Tensor:
    """Bring every expert output back to its token and mix each token's choices: (T, hidden).

    ``expert_out``: one row per row :func:`dispatch` delivered, in the same order (what
    ``LocalExperts`` returns); ``plan``: dispatch's plan; ``weights`` (T, k):
    ``Routing.weights``. Row t of the result is the sum, over token t's kept choices, of the
    choice's weight times its expert's output for token t; a token whose every choice was
    dropped gets zeros. Differentiable in ``expert_out`` and ``weights``.
    """
    if weights.shape != (plan.num_tokens, plan.k):
        raise ValueError(
            f"weights has shape {tuple(weights.shape)}: expected (T, k) = "
            f"({plan.num_tokens}, {plan.k}), the routing of the tokens that were dispatched"
        )
    if expert_out.shape[0] != sum(plan.recv_splits):
        raise ValueError(
            f"expert_out has {expert_out.shape[0]} rows but dispatch delivered "
            f"{sum(plan.recv_splits)}: pass one output per received row, in the same order"
        )
    # TODO 3.8: every expert output back to its token, weighted, summed over the token's choices.
    # Invariant: row t of the result is token t's (this rank's original order, not the order the
    #   rows travelled in): the sum over its kept choices of weight times expert output; a dropped
    #   choice adds nothing; exactly the rows received go back, each to the rank it came from;
    #   differentiable in expert_out and weights.
    # Hint 1: the rows come back in the order this rank sent them, and the plan remembers which
    #   (token, choice) each sent row stood for.
    # Hint 2: Which exchange brings the outputs back, and with which splits? Where does each
    #   returned row belong among the T x k (token, choice) places, and what fills the places of
    #   dropped choices? How is a token's output formed from its k places? Does autograd follow a
    #   write into a buffer made in place?
    # Hint 3: Back: the given all_to_all with the plan's splits swapped: receive what you sent, send
    #   what you received.
    # Hint 4: The places: a zero buffer of T times k rows; each returned row copied to the position
    #   the plan's order names for it, out of place (index_copy returns a new tensor), so that
    #   autograd follows; the places of dropped choices stay zero.
    # Hint 5: The mix: that buffer viewed as T by k by hidden, multiplied by the weights given a
    #   trailing dimension of size one (so they broadcast over hidden), summed over the k choices.
    # Hint 6: The outputs sent back with the splits swapped, placed by the plan's order into T times
    #   k zero rows, weighted per (token, choice) and summed over each token's choices.
    # See guidelines.md#38-expert-parallelism
    # >>> solution
    back = all_to_all(expert_out, plan.recv_splits, plan.send_splits, group)
    slots = back.new_zeros((plan.num_tokens * plan.k, *back.shape[1:]))
    slots = slots.index_copy(0, plan.order, back)
    per_choice = slots.view(plan.num_tokens, plan.k, *back.shape[1:])
    return (per_choice * weights.unsqueeze(-1)).sum(dim=1)
    # <<< solution


class MoELayer(nn.Module):
    """One rank's part of an expert-parallel mixture-of-experts layer (given).

    Built from the whole layer ``dense`` (``build_moe``, the same on every rank): a copy of the
    router (replicated) and copies of this rank's experts (``experts_of_rank``) on the
    expert-parallel ``group`` (None: the whole world). ``forward(tokens)`` takes this rank's
    tokens (T, hidden), T may differ between ranks, and returns ``(output, aux_loss)``: the
    output (T, hidden) and this rank's load-balancing loss (add ``coefficient * aux_loss`` to
    the training loss; Switch Transformer uses 0.01). ``self.last`` keeps what the last
    forward decided (a ``MoEStep``).
    """

    def __init__(self, dense: DenseMoE, group: Group = None) -> None:
        super().__init__()
        config = dense.config
        rank, ep = group_rank_and_size(group)
        check_moe_config(config, ep)
        self.config = config
        self.group = group
        self.router = copy.deepcopy(dense.router)
        held = experts_of_rank(config.num_experts, ep, rank)
        self.experts = LocalExperts([copy.deepcopy(dense.experts[i]) for i in held], held.start)
        self.last: MoEStep | None = None

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.config
        if tokens.dim() != 2 or tokens.shape[1] != config.hidden or tokens.shape[0] < 1:
            raise ValueError(
                f"tokens of shape {tuple(tokens.shape)}: expected (T, {config.hidden}) with at "
                "least one token on every rank (flatten batch and sequence first)"
            )
        rank, _ = group_rank_and_size(self.group)
        routing = route(self.router(tokens), config.k)
        census = gather_expert_counts(routing.experts, config.num_experts, self.group)
        capacity = expert_capacity(census, config.k, config.capacity_factor)
        keep = keep_within_capacity(routing.experts, census, rank, capacity)
        aux_loss = load_balancing_loss(routing.probs, routing.experts, config.num_experts)
        received, plan = dispatch(tokens, routing.experts, keep, config.num_experts, self.group)
        expert_out = self.experts(received, plan.recv_counts)
        output = combine(expert_out, plan, routing.weights, self.group)
        self.last = MoEStep(routing, keep, census, capacity, plan)
        return output, aux_loss


def _gradients(module: nn.Module, what: str) -> list[torch.Tensor]:
    grads = []
    for name, param in module.named_parameters():
        if param.grad is None:
            raise ValueError(
                f"{what} parameter {name} has no gradient: call backward on this rank's loss "
                "before syncing (every rank, also one whose experts got no token)"
            )
        grads.append(param.grad)
    return grads


def sync_moe_gradients(layer: MoELayer, layout: ExpertLayout) -> None:
    """After backward on every rank, turn each gradient into that of the MEAN of every rank's
    loss (ep x dp ranks, each loss the mean over that rank's own tokens), in place.

    ``layer`` was built on ``layout.ep_group``. Its router is replicated on every rank of the
    layout; each expert is held by one rank per replica (``layout.dp_group`` holds its copies).
    Afterwards the router's gradient is the same on every rank and every copy of an expert has
    the same gradient: what one process computes from the mean of all the ranks' losses.
    """
    router_grads = _gradients(layer.router, "router")
    expert_grads = _gradients(layer.experts, "expert")
    # TODO 3.8: every gradient made that of the mean of all ranks' losses, copies kept equal.
    # Invariant: afterwards every rank's router gradient, and every copy of an expert's gradient,
    #   equals what one process gets from the mean of all ep x dp ranks' losses; copies stay
    #   identical; no expert's gradient is ever added to another expert's.
    # Hint 1: for one expert, list whose losses its gradient already includes after backward and
    #   whose are still missing; do the same for the router, which every rank holds.
    # Hint 2: The router's copy on this rank saw only this rank's tokens: where are the other parts?
    #   An expert's rows came from every rank of its expert-parallel group, and the all-to-all's
    #   backward sent their gradients back to it: whose parts does it hold, and which ranks hold
    #   copies of the same expert that saw other tokens? Over how many losses is the mean, and is
    #   that the size of the group an expert's sum runs over?
    # Hint 3: The router: a sum over every rank of the layout (layout.world_group), divided by the
    #   number of ranks, layout.world_size.
    # Hint 4: An expert: a sum over the ranks holding its copies, one per replica (layout.dp_group);
    #   its own replica's parts are in already.
    # Hint 5: The expert's divisor: after the dp sum it holds the parts of all ep x dp losses, so
    #   the world size, not dp_size (with ep 2 and dp 2, dividing by 2 leaves it twice too large);
    #   Megatron-LM's expert_gradient_scaling_factor is 1 over the data-parallel size including ep
    #   for the same reason.
    # Hint 6: dist.all_reduce of each router gradient on the world group and of each expert gradient
    #   on the dp group, in place, every one then divided in place by the world size.
    # See guidelines.md#38-expert-parallelism
    # >>> solution
    world = layout.world_size
    for grad in router_grads:
        dist.all_reduce(grad, group=layout.world_group)
        grad.div_(world)
    # Each expert's gradient already sums its own replica's ep ranks (the all-to-all backward
    # brought their contributions); the other replicas' sums are on its dp group. Megatron-LM
    # scales expert gradients by 1/(full data-parallel size) too (distributed_data_parallel.py,
    # expert_gradient_scaling_factor).
    for grad in expert_grads:
        dist.all_reduce(grad, group=layout.dp_group)
        grad.div_(world)
    # <<< solution
