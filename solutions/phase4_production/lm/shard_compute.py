"""The compute one tensor-parallel rank runs for one dense layer, without its collectives.

Megatron-LM's split (Shoeybi et al., 2019, section 3): attention's fused ``qkv`` and SwiGLU's
``gate_up`` are column-parallel (each rank holds ``heads / tp`` heads and ``ffn / tp`` inner
features), ``out`` and ``down`` row-parallel (their input is the rank's share, their output the
whole width, summed over the group by the region that follows). The norms, without sequence
parallelism, run whole on every rank. The planner's rates (``lm.rates``) time this block at each
tensor-parallel degree rather than dividing one rank's time by ``tp``: small matrices run below
the rate of large ones, and the cost of each operation's call does not divide at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course.language_model import LMConfig, RMSNorm, apply_rotary


class ShardedBlock(nn.Module):
    """One rank's share of ``Block`` under ``tp``-way tensor parallelism (compute only)."""

    def __init__(self, config: LMConfig, tp: int) -> None:
        super().__init__()
        if config.heads % tp or config.ffn % tp:
            raise ValueError(f"tp={tp} must divide heads={config.heads} and ffn={config.ffn}")
        h, self.heads, self.head_dim = config.width, config.heads // tp, config.head_dim
        local = self.heads * self.head_dim
        self.attention_norm = RMSNorm(h, config.norm_eps)
        self.qkv = nn.Linear(h, 3 * local, bias=False)
        self.out = nn.Linear(local, h, bias=False)
        self.mlp_norm = RMSNorm(h, config.norm_eps)
        self.gate_up = nn.Linear(h, 2 * (config.ffn // tp), bias=False)
        self.down = nn.Linear(config.ffn // tp, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, tokens, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(
            apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, is_causal=True
        )
        x = x + self.out(mixed.transpose(1, 2).reshape(batch, tokens, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def tp_degrees(config: LMConfig, most: int = 8) -> list[int]:
    """The tensor-parallel degrees worth timing: those that divide the heads and the inner
    width, up to ``most``."""
    return [t for t in range(1, most + 1) if config.heads % t == 0 and config.ffn % t == 0]
