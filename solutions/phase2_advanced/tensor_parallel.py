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
        # Hint 2: What does fc1 hand to the GeLU, a slice of its features or the whole output, and
        #   what does fc2 then expect as its input? Which option of each layer's from_dense says so?
        #   Where do the forward's one all-reduce and the backward's one then happen?
        # Hint 3: fc1's slice of output features is exactly the slice of input features fc2's shard
        #   reads: it may stay sliced. Gathering it and cutting it again in fc2 costs two more
        #   collectives per block.
        # Hint 4: fc1 keeps its output sliced; fc2 is told that its input arrives sliced; both on
        #   the group. The forward's all-reduce is then fc2's g, the backward's fc1's f.
        # Hint 5: ColumnParallelLinear.from_dense of the dense fc1 on the group with gather_output
        #   off; RowParallelLinear.from_dense of the dense fc2 on the group with input_is_parallel
        #   on; the class built from the two.
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
        # Hint 2: If the rows of in_proj_weight were cut as one block, which of q, k and v would
        #   rank 0 hold? Which option of the column layer says that the rows are several stacked
        #   matrices, and how many? What does out_proj's input hold on this rank, and which option
        #   says so? Which constructor takes raw weights, and which a dense Linear?
        # Hint 3: Three fused parts: with E = 8, 4 heads of 2 and 2 ranks, rank 0 takes q rows 0-3,
        #   k rows 8-11 and v rows 16-19, its heads 0 and 1.
        # Hint 4: out_proj's input is this rank's heads side by side, already its slice of the input
        #   features: input_is_parallel, so nothing is cut again and the block's only forward
        #   all-reduce is out_proj's g.
        # Hint 5: ColumnParallelLinear.from_weights of in_proj_weight and in_proj_bias on the group
        #   with three fused parts; RowParallelLinear.from_dense of the attention's out_proj on the
        #   group with input_is_parallel; the class built from them, the number of heads and causal.
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
        # TODO 2.6: attention over this rank's heads, then the out-projection.
        # Invariant: the result equals the dense attention's output on every rank; the block
        #   communicates once each way, in qkv and out_proj and nowhere else.
        # Hint 1: qkv's output holds, at each position, this rank's q features, then its k features,
        #   then its v features, head after head in each; torch's scaled_dot_product_attention works
        #   per head on [batch, heads, seq, head_dim].
        # Hint 2: Into how many dimensions must qkv's output be viewed so that q/k/v and the heads
        #   each get their own, and in which order do they lie in memory? Which permutation puts
        #   them in the order attention wants, with q, k and v first so that they unpack? When is
        #   attention causal? Afterwards, in which order must positions and heads lie for out_proj,
        #   which reads this rank's heads side by side?
        # Hint 3: The view is batch, seq, 3 (q, k, v), local heads, head_dim, in that order: the
        #   order in which the output features are laid out.
        # Hint 4: The permutation puts the 3 first, then batch, heads, seq, head_dim; attention is
        #   causal when self.causal; on the way back the heads go after seq again and merge with
        #   head_dim into the last dimension.
        # Hint 5: qkv of x viewed as (batch, seq, 3, local heads, head_dim), permuted to (3, batch,
        #   heads, seq, head_dim) and unpacked into q, k and v; F.scaled_dot_product_attention with
        #   is_causal from self.causal; its dimensions 1 and 2 swapped back and reshaped to (batch,
        #   seq, everything else) for out_proj.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        batch, seq, _ = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.local_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [batch, local_heads, seq, head_dim]
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(heads.transpose(1, 2).reshape(batch, seq, -1))
        # <<< solution
