"""The weights of a mixture-of-experts layer: its settings, its experts, the layer from a seed.

A mixture-of-experts (MoE) layer replaces one feed-forward block by ``num_experts`` of them and a
router that sends each token to ``k`` of those experts (Shazeer et al., "Outrageously Large Neural
Networks: The Sparsely-Gated Mixture-of-Experts Layer", ICLR 2017). Only containers live here:
exercise 3.8 splits the experts over ranks (``phase3_multi_node/moe_experts.py`` has its given
helpers), and the language model of exercise 4.7 (``course/language_model.py``) uses the layer on
chosen blocks.

* :class:`MoEConfig`: the settings (3.8's ``check_moe_config`` refuses the bad ones);
* :class:`ExpertMLP`: one expert, the usual block ``Linear(h, f), GELU, Linear(f, h)``;
* :class:`DenseMoE` and :func:`build_moe`: the whole layer's weights (the router and every
  expert), the same on every rank for one seed, so that one process can compute the reference and
  every rank can cut its own experts from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: ``num_experts`` experts ``hidden -> ffn_hidden -> hidden``, each token sent
    to ``k`` of them; each expert takes at most ``capacity_factor`` times its fair share of the
    expert-parallel group's token choices (see ``moe_comm.expert_capacity``)."""

    hidden: int = 16
    ffn_hidden: int = 32
    num_experts: int = 4
    k: int = 2
    capacity_factor: float = 1.25


class ExpertMLP(nn.Module):
    """One expert: ``fc2(gelu(fc1(x)))``, ``hidden -> ffn_hidden -> hidden``."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class DenseMoE(nn.Module):
    """The whole layer's weights: ``router`` (``Linear(hidden, num_experts)``, no bias: its
    outputs are the logits) and ``experts`` (all ``num_experts`` of them). A container only:
    the forward pass is the exercise."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.hidden, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            ExpertMLP(config.hidden, config.ffn_hidden) for _ in range(config.num_experts)
        )


def build_moe(config: MoEConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> DenseMoE:
    """The whole layer from ``seed``, the same on every rank (built under a forked RNG, so the
    caller's random state is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dense = DenseMoE(config)
    return dense.to(dtype)
