# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase2.py
"""Exercise 2.6, part 3: Megatron's parallel MLP and self-attention.

A transformer layer is attention + MLP. Megatron-LM (Shoeybi et al., 2019, section 3, figure 3)
parallelizes both so that each block costs exactly one all-reduce in forward and one in
backward, each of batch x sequence x hidden values: four per transformer layer per step. Every
all-reduce runs on the tensor-parallel ``group`` (the whole world when None).

* ``ParallelMLP``: fc1 (hidden -> ffn) a ``ColumnParallelLinear``, GELU, fc2 (ffn -> hidden) a
  ``RowParallelLinear``; its dense reference is ``DenseMLP``.
* ``ParallelSelfAttention``: the heads split across ranks, each rank computing attention for its
  own heads only. Its dense reference is PyTorch's own ``nn.MultiheadAttention``.

Which options of the layers make that so is the exercise (guidelines.md#26-tensor-parallelism).

The library way (``torch.distributed.tensor.parallel``) is library/tensor_parallel.py; the demo
that compares all three with their dense references is demos/tensor_parallel.py:

    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.demos.tensor_parallel
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phase2_advanced.tensor_parallel_support import Group, check_divisible, tp_rank_and_size
from phase2_advanced.template_tensor_parallel_layers import ColumnParallelLinear, RowParallelLinear

# ----------------------------------------------------------------------------- the MLP


class DenseMLP(nn.Module):
    """The transformer MLP block on one device: Linear(hidden, ffn), GELU, Linear(ffn, hidden)."""

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelMLP(nn.Module):
    """Megatron's MLP: fc1 (a ColumnParallelLinear), GELU, fc2 (a RowParallelLinear).

    Equal to the dense MLP on every rank, with one all-reduce in forward and one in backward.
    """

    def __init__(self, fc1: ColumnParallelLinear, fc2: RowParallelLinear) -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    @classmethod
    def from_dense(cls, dense: DenseMLP, group: Group = None) -> ParallelMLP:
        """This rank's shard of ``dense`` (copied) on the tensor-parallel ``group`` (None: the
        world). Raises ValueError before any communication when the MLP's hidden size does not
        divide by the group's size."""
        _, tp_size = tp_rank_and_size(group)
        check_divisible(dense.fc1.out_features, "MLP hidden size", tp_size)
        # TODO 2.6: this rank's shard of the dense MLP, one all-reduce each way.
        # Invariant: the output equals the dense MLP's on every rank; one forward calls one
        #   all-reduce of the [batch, seq, hidden] activation and nothing else, and so does one
        #   backward; every shard's gradient is the matching part of the dense one.
        # Hint 1: GeLU works element by element: it can run on any slice of fc1's output features.
        # More hints: uv run python -m tests.hint 2.6
        # See guidelines.md#26-tensor-parallelism
        raise NotImplementedError(
            "TODO 2.6: this rank's shard of the dense MLP, one all-reduce each way "
            "(see phase2_advanced/guidelines.md#26-tensor-parallelism)"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


# ----------------------------------------------------------------------------- attention


def check_attention(attention: nn.MultiheadAttention) -> None:
    """Refuse the nn.MultiheadAttention options this parallel version does not reproduce."""
    problems = []
    if not attention.batch_first:
        problems.append("batch_first=False (build it with batch_first=True)")
    if not attention._qkv_same_embed_dim:
        problems.append("kdim/vdim differ from embed_dim (self-attention needs one input)")
    if attention.dropout:
        problems.append(
            f"dropout={attention.dropout} (would need a per-rank RNG, Megatron's RNG tracker)"
        )
    if attention.bias_k is not None or attention.add_zero_attn:
        problems.append("add_bias_kv / add_zero_attn")
    if problems:
        raise ValueError("cannot parallelize this nn.MultiheadAttention: " + "; ".join(problems))


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention with the heads split across ranks (batch-first input).

    Rank r of the group holds heads [r*h, (r+1)*h), where h = num_heads / tp_size: ``qkv`` (a
    ColumnParallelLinear) holds their rows of the in-projection, q's, then k's, then v's, and
    ``out_proj`` (a RowParallelLinear) their part of the output projection. Equal to
    ``nn.MultiheadAttention`` on every rank, with one all-reduce in forward and one in backward.
    """

    def __init__(
        self,
        qkv: ColumnParallelLinear,
        out_proj: RowParallelLinear,
        num_heads: int,
        causal: bool = False,
    ) -> None:
        super().__init__()
        check_divisible(num_heads, "number of attention heads", qkv.tp_size)
        self.qkv, self.out_proj = qkv, out_proj
        self.num_heads = num_heads
        self.local_heads = num_heads // qkv.tp_size
        self.head_dim = qkv.in_features // num_heads
        self.causal = causal

    @classmethod
    def from_dense(
        cls, attention: nn.MultiheadAttention, group: Group = None, *, causal: bool = False
    ) -> ParallelSelfAttention:
        """This rank's heads of ``attention`` (copied) on the tensor-parallel ``group`` (None: the
        world). Raises ValueError before any communication when the number of heads does not
        divide by the group's size."""
        check_attention(attention)
        _, tp_size = tp_rank_and_size(group)
        check_divisible(attention.num_heads, "number of attention heads", tp_size)
        # TODO 2.6: this rank's heads of the dense attention.
        # Invariant: qkv holds the in-projection's rows (weight and bias) of this rank's heads, q's,
        #   then k's, then v's; out_proj holds the out-projection's entries for those heads and its
        #   whole bias; the block communicates once each way.
        # Hint 1: nn.MultiheadAttention keeps q, k and v stacked in one [3E, E] in_proj_weight (and
        #   one [3E] in_proj_bias); the layers of tensor_parallel_layers.py can be built from raw
        #   weights.
        # More hints: uv run python -m tests.hint 2.6
        # See guidelines.md#26-tensor-parallelism
        raise NotImplementedError(
            "TODO 2.6: this rank's heads of the dense attention "
            "(see phase2_advanced/guidelines.md#26-tensor-parallelism)"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, seq, embed] -> [batch, seq, embed], replicated on every rank."""
        # TODO 2.6: attention over this rank's heads, then the out-projection.
        # Invariant: the result equals the dense attention's output on every rank; the block
        #   communicates once each way, in qkv and out_proj and nowhere else.
        # Hint 1: qkv's output holds, at each position, this rank's q features, then its k features,
        #   then its v features, head after head in each; torch's scaled_dot_product_attention works
        #   per head on [batch, heads, seq, head_dim].
        # More hints: uv run python -m tests.hint 2.6
        # See guidelines.md#26-tensor-parallelism
        raise NotImplementedError(
            "TODO 2.6: attention over this rank's heads, then the out-projection "
            "(see phase2_advanced/guidelines.md#26-tensor-parallelism)"
        )
