"""Exercise 3.8, part 1: the router's choice, the capacity rule and the load-balancing loss.

A mixture-of-experts layer sends each token to a few of its experts. Three decisions come before
any token moves, and none of them needs a message (the one number they share across ranks, the
census of how many choices each rank made for each expert, is gathered for you by
``moe_comm.gather_expert_counts``):

* **which experts** (:func:`route`): a softmax over the experts, the k most probable, and their
  probabilities rescaled so that each token's weights sum to 1 (Shazeer et al. 2017 keep the
  top-k; Mixtral and most top-2 models renormalize; with k = 1 the weight is then 1 and the router
  learns from the load-balancing loss alone, see the guide);
* **which choices fit** (:func:`keep_within_capacity`): an expert takes at most ``capacity``
  token choices per step from its whole expert-parallel group (``moe_comm.expert_capacity``),
  first come first served in a fixed order, so that every rank decides the same thing without
  asking: dropped choices are not sent at all, and the token keeps its other choices (a token
  that loses all of them leaves the layer as zeros, and the residual connection around the layer
  carries it on, as in Switch Transformer);
* **how unbalanced that was** (:func:`load_balancing_loss`): the auxiliary loss of Switch
  Transformer (Fedus, Zoph and Shazeer, "Switch Transformers: Scaling to Trillion Parameter
  Models with Simple and Efficient Sparsity", JMLR 2022, arXiv:2101.03961, section 2.2, eq. 4-6)
  and GShard (Lepikhin et al., "GShard: Scaling Giant Models with Conditional Computation and
  Automatic Sharding", 2020, arXiv:2006.16668, section 2.2), added to the training loss so that
  the router learns to spread the tokens.
"""

from __future__ import annotations

import torch

from phase3_multi_node.moe_comm import Routing, count_choices


def _check_choices(experts: torch.Tensor, name: str = "experts") -> None:
    if experts.dim() != 2 or experts.dtype != torch.long:
        raise ValueError(
            f"{name} has shape {tuple(experts.shape)} and dtype {experts.dtype}: expected a "
            "(tokens, k) int64 tensor of expert indices (Routing.experts)"
        )


def route(logits: torch.Tensor, k: int) -> Routing:
    """The router's decision for each token, from its ``logits`` (T, num_experts).

    Returns a :class:`~phase3_multi_node.moe_comm.Routing`: ``probs``, the softmax of the logits
    over the experts; ``experts`` (T, k), each token's k most probable experts, the most probable
    first; ``weights`` (T, k), the probabilities of those k experts, in the same order, rescaled
    so that each token's k weights sum to 1. All three stay differentiable in ``logits``.
    """
    if logits.dim() != 2 or not 1 <= k <= logits.shape[-1]:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} with k={k}: expected (tokens, num_experts) "
            "and 1 <= k <= num_experts"
        )
    # TODO 3.8: each token's k most probable experts, and weights that sum to 1 per token.
    # Invariant: every row of probs sums to 1 over all experts; experts[t] holds k distinct experts
    #   in decreasing probability; weights[t] are their probabilities in that order, scaled by one
    #   common factor per token so that the row sums to 1; probs and weights carry the gradient back
    #   to the logits.
    # Hint 1: the choice itself (which indices) needs no gradient; the router learns through what
    #   the experts are weighted by.
    # Hint 2: Over which dimension is the softmax taken? Which torch function gives the k largest
    #   values of each row and where they are, and in which order? Through which outputs must the
    #   gradient reach the logits, and may anything here be detached? What single number per token
    #   makes its k weights sum to 1?
    # Hint 3: The probabilities: the softmax over the last dimension, the experts; each row is one
    #   token's distribution.
    # Hint 4: torch.topk over the experts returns the k largest values and their indices, largest
    #   first: the indices are the experts, the values their probabilities, still attached to the
    #   graph.
    # Hint 5: A token whose chosen probabilities are 0.5 and 0.3 gets the weights 0.625 and 0.375:
    #   each divided by their sum, 0.8.
    # Hint 6: The softmax of the logits over the experts; its top k over the same dimension; the
    #   chosen probabilities divided by their sum per token (kept as a column, so that it
    #   broadcasts); a Routing of the indices, the weights and the probabilities.
    # See guidelines.md#38-expert-parallelism
    # >>> solution
    probs = torch.softmax(logits, dim=-1)
    top_probs, top_experts = probs.topk(k, dim=-1)
    weights = top_probs / top_probs.sum(dim=-1, keepdim=True)
    return Routing(top_experts, weights, probs)
    # <<< solution


def keep_within_capacity(
    experts: torch.Tensor, census: torch.Tensor, rank: int, capacity: int
) -> torch.Tensor:
    """Which of this rank's token choices their experts accept: a (T, k) bool tensor.

    ``experts`` (T, k): this rank's choices (``Routing.experts``); ``census`` (ep, num_experts):
    ``census[r, e]`` choices of group rank r named expert e (``gather_expert_counts``; the row
    of ``rank`` is this rank's own count); ``capacity``: the most choices one expert takes from
    the whole group (``expert_capacity``).

    The rule, the same on every rank and every run: each expert accepts choices first come
    first served in (group rank, token) order: all of rank 0's choices for it before any of
    rank 1's, and within a rank, token 0's before token 1's, until it holds ``capacity``. A
    token never names one expert twice, so its k choices never compete with each other.
    """
    _check_choices(experts)
    num_experts = census.shape[-1]
    if census.dim() != 2 or not 0 <= rank < census.shape[0]:
        raise ValueError(
            f"census of shape {tuple(census.shape)} and rank={rank}: expected "
            "(group size, num_experts) from gather_expert_counts and a rank inside the group"
        )
    if not torch.equal(census[rank].cpu(), count_choices(experts, num_experts).cpu()):
        raise ValueError(
            f"census row {rank} is {census[rank].tolist()} but this rank's choices count "
            f"{count_choices(experts, num_experts).tolist()} per expert: pass the census of these "
            "choices and this rank's index in the group that gathered it"
        )
    # TODO 3.8: keep exactly the choices that come within their expert's capacity, group-wide.
    # Invariant: for every expert, the kept choices of the whole group are exactly its first
    #   `capacity` choices in (group rank, token) order, or all of them when there are fewer; no
    #   randomness, no probabilities: every rank decides its own choices alone, and the ranks'
    #   decisions fit together without a message.
    # Hint 1: picture each expert's queue across the whole group: before this rank's first token,
    #   the ranks in front of it have queued some choices for each expert already.
    # Hint 2: For one choice of this rank, how many choices for the same expert stand ahead of it:
    #   from the ranks before this one, and from this rank's own earlier tokens? Which of your
    #   inputs tells you the first number without a message? When is a choice at place p kept,
    #   counting places from 0?
    # Hint 3: Ahead of this rank, per expert: the census rows of the ranks before it, summed over
    #   those ranks (its own row is not ahead of it).
    # Hint 4: Ahead within this rank: read the (T, k) choices row by row, as flattening gives them;
    #   for each choice, the number of this rank's earlier choices that named the same expert, which
    #   is a running count per expert (a cumulative sum over the one-hot encoding of the flattened
    #   choices) minus the choice itself.
    # Hint 5: A choice's place is the two counts for its expert added; it is kept when the place is
    #   below capacity. The guide's example: 2 choices for expert 2 before rank 1, whose token 0
    #   takes place 2 (kept, capacity 3) and token 2 place 3 (dropped).
    # Hint 6: Flatten the choices; for each, the census rows above this rank summed for its expert,
    #   plus its running count of earlier same-expert choices in this rank; a place below capacity
    #   is kept; the mask reshaped like the choices.
    # See guidelines.md#38-expert-parallelism
    # >>> solution
    flat = experts.flatten()
    # Choices for each expert queued by the ranks before this one.
    before_rank = census[:rank].sum(dim=0).to(flat.device)
    # Running count per expert over this rank's choices in token order, minus the choice itself:
    # the number of this rank's earlier choices for the same expert.
    running = torch.nn.functional.one_hot(flat, num_experts).cumsum(dim=0)
    earlier_here = running.gather(1, flat.unsqueeze(1)).squeeze(1) - 1
    place = before_rank[flat] + earlier_here
    return (place < capacity).view_as(experts)
    # <<< solution


def load_balancing_loss(
    probs: torch.Tensor, experts: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """The auxiliary load-balancing loss of this rank's T tokens (a scalar tensor).

    ``num_experts * sum over experts e of f_e * P_e``, where ``f_e`` is the fraction of this
    rank's T x k token choices (all of them, before capacity drops any) that named expert e, and
    ``P_e`` is expert e's router probability averaged over the T tokens (Switch Transformer eq.
    4-6 with k choices per token, as Megatron-LM's ``switch_load_balancing_loss_func`` counts
    them). It is 1 when choices and probabilities are spread evenly and grows towards
    ``num_experts`` as both pile onto one expert. ``f`` is a count and carries no gradient;
    the router learns through ``P``: lowering the probability of the experts that are
    already overloaded.
    """
    _check_choices(experts)
    if probs.dim() != 2 or probs.shape != (experts.shape[0], num_experts):
        raise ValueError(
            f"probs has shape {tuple(probs.shape)}: expected (tokens, num_experts) = "
            f"({experts.shape[0]}, {num_experts}), Routing.probs of the same tokens"
        )
    if experts.shape[0] == 0:
        raise ValueError("no tokens: the load-balancing loss averages over at least one token")
    # TODO 3.8: the load-balancing loss of this rank's tokens.
    # Invariant: num_experts times the sum over the experts of f_e times P_e: f_e the fraction of
    #   all T x k choices that named e (before capacity), P_e e's probability averaged over the T
    #   tokens; 1 for an even router; its gradient reaches probs through P only.
    # Hint 1: two vectors over the experts, one from the choices and one from the probabilities;
    #   each sums to 1.
    # Hint 2: How many choices are there in all, and how many named each expert (which given helper
    #   counts them)? Over which dimension of probs is the mean taken? Which of the two vectors may
    #   carry a gradient, and in which dtype must f be to multiply P?
    # Hint 3: f: count_choices of the experts, made the dtype of probs, divided by the number of
    #   choices, T times k (the number of elements of experts), not by T.
    # Hint 4: P: the mean of probs over the tokens, its first dimension: one value per expert.
    # Hint 5: num_experts times the sum over the experts of f times P: a scalar tensor.
    # See guidelines.md#38-expert-parallelism
    # >>> solution
    fraction = count_choices(experts, num_experts).to(probs.dtype) / experts.numel()
    mean_prob = probs.mean(dim=0)
    return num_experts * torch.sum(fraction * mean_prob)
    # <<< solution
