# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
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
from phase3_multi_node.template_moe_routing import (
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
    # More hints: uv run python -m tests.hint 3.8
    # See guidelines.md#38-expert-parallelism
    raise NotImplementedError(
        "TODO 3.8: every kept choice's row to the rank of its expert, and the plan to undo it "
        "(see phase3_multi_node/guidelines.md#38-expert-parallelism)"
    )


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
    # More hints: uv run python -m tests.hint 3.8
    # See guidelines.md#38-expert-parallelism
    raise NotImplementedError(
        "TODO 3.8: every expert output back to its token, weighted, summed over the token's "
        "choices "
        "(see phase3_multi_node/guidelines.md#38-expert-parallelism)"
    )


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
    # More hints: uv run python -m tests.hint 3.8
    # See guidelines.md#38-expert-parallelism
    raise NotImplementedError(
        "TODO 3.8: every gradient made that of the mean of all ranks' losses, copies kept equal "
        "(see phase3_multi_node/guidelines.md#38-expert-parallelism)"
    )
