"""One process running every expert on every token: what exercise 3.8 must equal.

The expert-parallel layer (``expert_parallel.MoELayer`` on an expert-parallel group of ep ranks)
must compute exactly what a single process computes when it holds every expert and sees every
rank's tokens. This module is that single process, written the plainest way (a loop over
tokens, then over each token's choices) so that it shares no code path with the exercise: the
graders, the demo and the benchmark compare against it.

    results = reference_group(dense, [tokens_of_rank_0, tokens_of_rank_1, ...])

returns, for every rank of one expert-parallel group, which experts each token chose, the
weights, which choices were kept, the output and the load-balancing loss, all differentiable
in the weights of ``dense`` and in the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phase3_multi_node.moe_comm import expert_capacity
from phase3_multi_node.moe_experts import DenseMoE


@dataclass
class ReferenceRank:
    """What one rank's tokens get from the single process."""

    experts: list[list[int]]  # per token, its k experts, the most probable first
    weights: torch.Tensor  # (T, k)
    keep: list[list[bool]]  # per token and choice
    probs: torch.Tensor  # (T, E)
    output: torch.Tensor  # (T, hidden)
    aux_loss: torch.Tensor  # scalar

    @property
    def keep_tensor(self) -> torch.Tensor:
        return torch.tensor(self.keep, dtype=torch.bool)

    @property
    def experts_tensor(self) -> torch.Tensor:
        return torch.tensor(self.experts, dtype=torch.long)


def _top_k(row: torch.Tensor, k: int) -> list[int]:
    """The k largest entries' positions, largest first (ties: the lower index first)."""
    values = row.tolist()
    return sorted(range(len(values)), key=lambda e: (-values[e], e))[:k]


def capacity_of(dense: DenseMoE, tokens_per_rank: Sequence[int]) -> int:
    """The capacity per expert for a group whose ranks hold these numbers of tokens."""
    config = dense.config
    census = torch.zeros(1, config.num_experts, dtype=torch.long)
    census[0, 0] = sum(tokens_per_rank) * config.k  # only the total matters
    return expert_capacity(census, config.k, config.capacity_factor)


def reference_group(dense: DenseMoE, inputs: Sequence[torch.Tensor]) -> list[ReferenceRank]:
    """Every rank of one expert-parallel group, computed in this process: ``inputs[r]`` are
    group rank r's tokens (T_r, hidden)."""
    config = dense.config
    num_experts, k = config.num_experts, config.k
    chosen: list[list[list[int]]] = []
    probs_of: list[torch.Tensor] = []
    weights_of: list[torch.Tensor] = []
    for tokens in inputs:
        probs = torch.softmax(dense.router(tokens), dim=-1)
        picks = [_top_k(probs[t].detach(), k) for t in range(tokens.shape[0])]
        rows = []
        for t, experts in enumerate(picks):
            picked = torch.stack([probs[t, e] for e in experts])
            rows.append(picked / picked.sum())
        chosen.append(picks)
        probs_of.append(probs)
        weights_of.append(torch.stack(rows))
    capacity = capacity_of(dense, [x.shape[0] for x in inputs])
    taken = [0] * num_experts
    keeps: list[list[list[bool]]] = []
    for picks in chosen:  # group rank order, then token order: first come, first served
        rank_keep = []
        for experts in picks:
            flags = []
            for e in experts:
                flags.append(taken[e] < capacity)
                taken[e] += flags[-1]
            rank_keep.append(flags)
        keeps.append(rank_keep)
    results = []
    for tokens, picks, weights, probs, keep in zip(
        inputs, chosen, weights_of, probs_of, keeps, strict=True
    ):
        outputs = []
        for t, experts in enumerate(picks):
            out = torch.zeros_like(tokens[t])
            for j, e in enumerate(experts):
                if keep[t][j]:
                    out = out + weights[t, j] * dense.experts[e](tokens[t : t + 1])[0]
            outputs.append(out)
        counts = torch.zeros(num_experts, dtype=probs.dtype)
        for experts in picks:
            for e in experts:
                counts[e] += 1
        fraction = counts / (len(picks) * k)
        aux = num_experts * torch.sum(fraction * probs.mean(dim=0))
        results.append(ReferenceRank(picks, weights, keep, probs, torch.stack(outputs), aux))
    return results
