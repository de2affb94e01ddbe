"""A small transformer block whose attention can be ring attention, and its training step.

Given (not an exercise): the 2.7 grader, demo and benchmark train this block once in one process
on the whole sequence (``attention`` = ``scaled_dot_product_attention``) and once split over a
context-parallel group (``attention`` = your ``ring_attention`` on each rank's chunks), and
compare. Everything in the block except attention works token by token (layer norms, the q/k/v
and output projections, the MLP), so on a rank's local tokens it computes exactly that rank's
rows of the whole block's output; only attention needs the other ranks' tokens.

What context parallelism adds to training, beside attention:

* **The loss is a sum over every token of the sequence.** Each rank computes its tokens' part,
  divided by the *global* count of elements, so the parts add up to the one-process loss.
* **Every rank holds the whole block (weights replicated in the group), and each rank's gradient
  is only its tokens' share.** The shares are summed over the group (one all-reduce per
  parameter) before the optimizer step, exactly like data parallelism over the sequence
  (Megatron-LM and torchtitan fold the context-parallel group into the data-parallel one for
  this all-reduce). The attention's backward already brought every rank the dK/dV of its own
  tokens from the others, so nothing else is needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(causal: bool) -> Attention:
    """One-process attention on the whole sequence: ``scaled_dot_product_attention``."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return attention


class AttentionBlock(nn.Module):
    """Pre-norm transformer block: ``x + proj(attention(q, k, v))``, then ``x + MLP(norm(x))``.

    ``forward(x, attention)`` takes x [batch, tokens, dim] and an attention callable on
    [batch, heads, tokens, head_dim] q, k, v, so one set of weights can run either way.
    """

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, attention: Attention) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, tokens, head_dim]
        mixed = attention(q, k, v).transpose(1, 2).reshape(batch, tokens, dim)
        x = x + self.proj(mixed)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def build_block(
    dim: int,
    heads: int,
    hidden: int,
    seed: int,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> AttentionBlock:
    """The same block on every rank (and in the one-process reference), from ``seed``."""
    torch.manual_seed(seed)
    return AttentionBlock(dim, heads, hidden).to(device=device, dtype=dtype)


def train_steps(
    block: AttentionBlock,
    x: torch.Tensor,
    target: torch.Tensor,
    attention: Attention,
    *,
    steps: int,
    lr: float = 1e-2,
    group: dist.ProcessGroup | None = None,
    total_elements: int | None = None,
) -> list[float]:
    """Train ``block`` for ``steps`` AdamW steps on the loss sum((block(x) - target)^2) / N.

    In one process (``total_elements`` None), ``x`` and ``target`` are the whole sequence and N
    their element count; nothing is communicated. Split over a context-parallel ``group`` (None:
    the world), they are this rank's tokens and ``total_elements`` is N of the whole sequence:
    gradients are summed over the group before each step, and the returned losses are the whole
    sequence's (summed over the group). Returns the loss of every step.
    """
    split = total_elements is not None
    count = total_elements if total_elements is not None else target.numel()
    optimizer = torch.optim.AdamW(block.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = ((block(x, attention) - target) ** 2).sum() / count
        loss.backward()
        reported = loss.detach().clone()
        if split:
            for param in block.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=group)  # sum of every rank's tokens' share
            dist.all_reduce(reported, group=group)
        optimizer.step()
        losses.append(float(reported))
    return losses
