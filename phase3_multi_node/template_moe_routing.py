# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
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
    # More hints: uv run python -m tests.hint 3.8
    # See guidelines.md#38-expert-parallelism
    raise NotImplementedError(
        "TODO 3.8: each token's k most probable experts, and weights that sum to 1 per token "
        "(see phase3_multi_node/guidelines.md#38-expert-parallelism)"
    )


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
    # More hints: uv run python -m tests.hint 3.8
    # See guidelines.md#38-expert-parallelism
    raise NotImplementedError(
        "TODO 3.8: keep exactly the choices that come within their expert's capacity, group-wide "
        "(see phase3_multi_node/guidelines.md#38-expert-parallelism)"
    )


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
    # More hints: uv run python -m tests.hint 3.8
    # See guidelines.md#38-expert-parallelism
    raise NotImplementedError(
        "TODO 3.8: the load-balancing loss of this rank's tokens "
        "(see phase3_multi_node/guidelines.md#38-expert-parallelism)"
    )
