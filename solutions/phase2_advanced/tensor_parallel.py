"""Exercise 2.6, part 3: Megatron's parallel MLP and self-attention.

A transformer layer is attention + MLP. Megatron-LM (Shoeybi et al., 2019, section 3, figure 3)
parallelizes both with the same pattern: a column-parallel layer, an element-wise (or per-head)
middle, a row-parallel layer. The middle needs no communication, so each block costs exactly one
all-reduce in forward (g, after the row-parallel layer) and one in backward (f, before the
column-parallel one): four per transformer layer per step, each of batch x sequence x hidden
values. Every all-reduce runs on the tensor-parallel ``group`` (the whole world when None).

* ``ParallelMLP``: fc1 (hidden -> ffn) split by output features, GELU on the slice, fc2
  (ffn -> hidden) split by input features.
* ``ParallelSelfAttention``: heads split across ranks. The fused QKV projection is
  column-parallel so each rank computes q, k and v of *its* heads; attention runs per head, on
  this rank's heads only; the output projection is row-parallel. Its dense reference is PyTorch's
  own ``nn.MultiheadAttention``.

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
from solutions.phase2_advanced.tensor_parallel_layers import ColumnParallelLinear, RowParallelLinear

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
    """Megatron's MLP: fc1 column-parallel (no gather), GELU on the slice, fc2 row-parallel.

    GELU is element-wise, so applying it to this rank's slice of fc1's output is the same as
    applying it to the whole and slicing: the only communication is fc1's f (backward) and
    fc2's g (forward).
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
        # TODO 2.6: build fc1 and fc2 so that the MLP needs one all-reduce each way.
        # Invariant: fc1's output on this rank is exactly the slice of features fc2's weight
        #   shard expects, so nothing is gathered between them; the output is replicated.
        # Hint 1: fc1 keeps its output split (no gather); fc2 is told its input is already
        #   split, so it does not slice it again.
        # Hint 2: Which layer's output may stay split across the ranks, and which layer's input
        #   arrives split? Which option of each layer's from_dense says so? Where does the one
        #   all-reduce of the forward then happen?
        # Hint 3: Two from_dense calls, one per layer, each given the group: fc1 column-parallel
        #   with its output left split (gather_output off), fc2 row-parallel told that its input is
        #   already split (input_is_parallel on); then the class built from the two.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        fc1 = ColumnParallelLinear.from_dense(dense.fc1, group, gather_output=False)
        fc2 = RowParallelLinear.from_dense(dense.fc2, group, input_is_parallel=True)
        return cls(fc1, fc2)
        # <<< solution

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

    ``qkv`` is column-parallel over the fused [q; k; v] projection (``fused_parts=3``), so rank
    r computes q, k and v for heads [r*h, (r+1)*h) where h = num_heads / tp_size. Heads are
    independent until the output projection, which is row-parallel: its input features are the
    concatenated heads, so this rank's heads are exactly its input slice.
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
        # TODO 2.6: shard the fused QKV projection by heads and the output projection by rows.
        # Invariant: this rank's qkv output holds [q; k; v] of its own heads only; out_proj
        #   takes those heads' outputs (input_is_parallel) and reduces once.
        # Hint 1: nn.MultiheadAttention keeps q, k, v stacked in one [3E, E] in-projection (and
        #   its bias): a contiguous slice of its rows would give rank 0 only q's. The layers of
        #   tensor_parallel_layers.py can be built from raw weights, with fused parts.
        # Hint 2: qkv column-parallel from the fused in-projection's weight and bias (three
        #   fused parts); out_proj row-parallel from the dense out_proj, its input already
        #   split; both on the group; then the class built from them, the number of heads and
        #   causal.
        # Hint 3: ColumnParallelLinear.from_weights takes the attention's in_proj_weight and
        #   in_proj_bias, the group, and fused_parts (q, k and v: 3); RowParallelLinear's
        #   from_dense takes the attention's out_proj with input_is_parallel set.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        qkv = ColumnParallelLinear.from_weights(
            attention.in_proj_weight, attention.in_proj_bias, group, fused_parts=3
        )
        out_proj = RowParallelLinear.from_dense(attention.out_proj, group, input_is_parallel=True)
        return cls(qkv, out_proj, attention.num_heads, causal)
        # <<< solution

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, seq, embed] -> [batch, seq, embed], replicated on every rank."""
        # TODO 2.6: attention over this rank's heads, then the row-parallel output projection.
        # Invariant: the result equals the dense attention's output on every rank; the only
        #   communication is qkv's f (backward) and out_proj's g (forward).
        # Hint 1: qkv(x) holds, for each position, q, k and v of this rank's heads, one after
        #   the other, each head-major; torch's scaled_dot_product_attention works per head
        #   on [batch, heads, seq, head_dim]; out_proj wants this rank's heads side by side.
        # Hint 2: one view of qkv(x) into five dimensions (batch, seq, the three of q/k/v, local
        #   heads, head_dim) and one permute gives q, k and v, each [batch, local heads, seq,
        #   head_dim]; one attention call (causal when self.causal); then the inverse: heads
        #   back after seq, flattened into the last dimension, into out_proj.
        # Hint 3: view as (batch, seq, 3, local heads, head_dim), then permute the dimensions
        #   into the order (3, batch, heads, seq, head_dim), and unpack q, k, v along the first;
        #   F.scaled_dot_product_attention with is_causal from self.causal; swap dims 1 and 2
        #   back and reshape to (batch, seq, everything else) before out_proj.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        batch, seq, _ = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.local_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [batch, local_heads, seq, head_dim]
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(heads.transpose(1, 2).reshape(batch, seq, -1))
        # <<< solution
