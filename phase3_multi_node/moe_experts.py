"""Given for exercise 3.8: the settings of a mixture-of-experts layer, its experts, and the
whole model built from one seed.

A mixture-of-experts (MoE) layer replaces one feed-forward block by ``num_experts`` of them and a
router that sends each token to ``k`` of those experts (Shazeer et al., "Outrageously Large Neural
Networks: The Sparsely-Gated Mixture-of-Experts Layer", ICLR 2017). Nothing here is the exercise:

* :class:`MoEConfig` (from ``course/moe_model.py``) and :func:`check_moe_config`: the settings,
  every bad one refused at once with its fix, before any process group work (a rank that raises
  inside an all-to-all leaves its peers waiting);
* :class:`ExpertMLP`, :class:`DenseMoE` and :func:`build_moe` (from ``course/moe_model.py``, where
  the language model of 4.7 finds them too): one expert, the whole layer's weights (the router
  and every expert), the same on every rank for one seed, so that one process can compute the
  reference and every rank can cut its own experts from it;
* :func:`experts_of_rank`: which experts a rank of the expert-parallel group holds (contiguous
  blocks of ``num_experts / ep``, rank order);
* :class:`LocalExperts`: this rank's experts, run on the rows an all-to-all delivered. Those rows
  arrive grouped by the rank that sent them, and inside each sender's block by expert; the experts
  want them grouped by expert. :meth:`LocalExperts.forward` regroups, runs each expert once on
  all its rows (also on none: every expert parameter then has a gradient, zero when the expert
  saw no token), and puts the outputs back in the order the rows arrived.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from course.moe_model import DenseMoE, ExpertMLP, MoEConfig, build_moe

__all__ = [
    "DenseMoE",
    "ExpertMLP",
    "LocalExperts",
    "MoEConfig",
    "build_moe",
    "check_moe_config",
    "experts_of_rank",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_moe_config(config: MoEConfig, ep: int, dp: int = 1) -> None:
    """Refuse settings that cannot run, all problems at once, each with its fix (ValueError).

    ``ep`` ranks share the experts (each holds ``num_experts / ep`` of them, so ``ep`` must divide
    ``num_experts``); ``dp`` replicas of that group train on different tokens."""
    problems: list[str] = []
    for name in ("hidden", "ffn_hidden", "num_experts", "k"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name}={value!r}: must be a whole number >= 1")
    for name, value in (("ep", ep), ("dp", dp)):
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name}={value!r}: every parallel degree must be >= 1")
    cf = config.capacity_factor
    if not isinstance(cf, (int, float)) or not math.isfinite(cf) or cf <= 0:
        problems.append(
            f"capacity_factor={cf!r}: must be a finite number > 0 (1.0 = each expert takes its "
            "fair share of the token choices; 1.25 is Switch Transformer's usual value)"
        )
    experts, k = config.num_experts, config.k
    if isinstance(experts, int) and experts >= 1 and isinstance(k, int) and k > experts:
        problems.append(
            f"k={k} > num_experts={experts}: a token goes to k different experts; "
            f"choose k <= {experts}"
        )
    valid = isinstance(experts, int) and experts >= 1 and isinstance(ep, int) and ep >= 1
    if valid and experts % ep:
        problems.append(
            f"ep={ep} does not divide num_experts={experts}: every expert-parallel rank holds "
            f"num_experts/ep whole experts; choose ep in {_divisors(experts)} or a number of "
            f"experts that is a multiple of {ep} (e.g. {experts // ep * ep + ep})"
        )
    if problems:
        raise ValueError("; ".join(problems))


def experts_of_rank(num_experts: int, ep: int, ep_rank: int) -> range:
    """The experts expert-parallel rank ``ep_rank`` of ``ep`` holds: a contiguous block of
    ``num_experts / ep``, in rank order (rank 0 the first ones)."""
    if ep < 1 or num_experts % ep or not 0 <= ep_rank < ep:
        raise ValueError(
            f"ep_rank={ep_rank} of ep={ep} with num_experts={num_experts}: ep must divide the "
            "number of experts and 0 <= ep_rank < ep"
        )
    per_rank = num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


class LocalExperts(nn.Module):
    """This rank's experts (copies of ``experts[first:first + len(experts)]`` of the whole layer).

    ``forward(received, recv_counts)``: ``received`` holds the rows an all-to-all delivered,
    grouped by sender (group rank 0's rows first) and, inside each sender's block, by this rank's
    experts in order; ``recv_counts[s, j]`` is how many rows sender ``s`` sent to local expert
    ``j``. Returns each row's expert output, in the same order as ``received``."""

    def __init__(self, experts: list[nn.Module], first: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.first = first  # the global index of experts[0]

    @property
    def global_ids(self) -> range:
        """The global expert index of each local expert, in order."""
        return range(self.first, self.first + len(self.experts))

    def forward(self, received: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        local = len(self.experts)
        if recv_counts.dim() != 2 or recv_counts.shape[1] != local:
            raise ValueError(
                f"recv_counts has shape {tuple(recv_counts.shape)}: expected (senders, {local}), "
                "one row per rank of the group and one column per local expert"
            )
        counts = recv_counts.to(device="cpu", dtype=torch.long)
        if int(counts.sum()) != received.shape[0] or bool((counts < 0).any()):
            raise ValueError(
                f"recv_counts add up to {int(counts.sum())} rows but {received.shape[0]} rows "
                "arrived: the counts must say how many rows each sender sent to each local expert"
            )
        # The local expert of every received row, then the rows grouped by expert (stable, so a
        # sender's rows keep their order inside each expert's group).
        expert_of_row = torch.arange(local).repeat(counts.shape[0])
        expert_of_row = expert_of_row.repeat_interleave(counts.flatten())
        by_expert = torch.argsort(expert_of_row, stable=True).to(received.device)
        grouped = received.index_select(0, by_expert)
        sizes = torch.bincount(expert_of_row, minlength=local).tolist()
        outputs = [
            expert(rows)
            for expert, rows in zip(self.experts, torch.split(grouped, sizes), strict=True)
        ]
        flat = torch.cat(outputs) if outputs else grouped
        return torch.zeros_like(flat).index_copy(0, by_expert, flat)
