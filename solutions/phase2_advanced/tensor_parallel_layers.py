"""Exercise 2.6, part 2: column- and row-parallel linear layers (Megatron-LM, section 3).

A linear layer computes ``y = x W^T + b`` with ``W`` of shape [out, in]. It can be split across
the n ranks of a group in two ways:

* column-parallel: every rank holds the whole (replicated) x and computes an equal slice of y's
  output features; with ``gather_output``, the whole y on every rank;
* row-parallel: every rank holds an equal slice of x's input features (``input_is_parallel``,
  or the whole x, cut here) and the layer returns the whole y on every rank. Its bias is
  replicated: every rank holds all of it.

Both are compared with the dense layer: outputs, the input's gradient, every shard's gradient,
and every copy of the replicated bias gets the whole bias gradient.
guidelines.md#26-tensor-parallelism asks where the operators of tensor_parallel_ops.py go and
where the bias enters.

Both layers are built from a dense ``nn.Linear`` (``from_dense``) so that tests and the demo can
compare them with it. Every layer works on its tensor-parallel ``group`` (None: the whole world),
and its collectives stay in the group. PyTorch's counterparts are ``ColwiseParallel`` /
``RowwiseParallel`` in ``torch.distributed.tensor.parallel`` (see library/tensor_parallel.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phase2_advanced.tensor_parallel_support import (
    Group,
    check_divisible,
    tp_rank_and_size,
    uniform_like_linear,
)
from solutions.phase2_advanced.tensor_parallel_ops import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)

__all__ = ["check_divisible"]  # given, used by tensor_parallel.py and the demo


def column_shard(
    weight: torch.Tensor, rank: int, world_size: int, fused_parts: int = 1
) -> torch.Tensor:
    """Rank ``rank``'s part of ``weight`` (or of a bias) for a column-parallel layer: the
    entries that compute its output features.

    ``fused_parts`` > 1 says that the output features are that many equal matrices stacked (a
    fused QKV projection: [q; k; v]); each is split among the ranks on its own, and the result
    holds the rank's part of each, in stacking order. Returns a copy.
    """
    if weight.shape[0] % fused_parts:
        raise ValueError(
            f"{weight.shape[0]} output features cannot be {fused_parts} equal fused parts"
        )
    check_divisible(weight.shape[0] // fused_parts, "output size", world_size)
    # TODO 2.6: this rank's part of a column-parallel weight (or bias), from each fused part.
    # Invariant: the result holds the entries that compute this rank's output features, of each of
    #   the fused_parts stacked matrices in stacking order; the ranks' results together hold every
    #   entry once; a copy, not a view of weight.
    # Hint 1: W is [out, in] and a bias is [out]: which dimension lists the output features?
    # Hint 2: Which dimension do you cut, and how wide is one rank's piece of one part? Where does
    #   rank r's piece start? With fused_parts = 3 the rows are three matrices stacked (q, k, v): if
    #   you cut the rows as one block, which of them would rank 0 get? Should the result share
    #   memory with the dense weight?
    # Hint 3: The first dimension, the output features: a bias of 8 entries over 2 ranks gives rank
    #   1 entries 4 to 7.
    # Hint 4: With parts, each part is cut on its own: 24 rows in 3 parts over 2 ranks give each
    #   part 8 rows, and rank 1 rows 4-7, then 12-15, then 20-23.
    # Hint 5: The width is the rows over fused_parts over world_size; cut the weight into
    #   fused_parts blocks along the first dimension; from each, the rows from rank times width up
    #   to (rank + 1) times width; concatenate the pieces in block order and clone.
    # See guidelines.md#26-tensor-parallelism
    # >>> solution
    width = weight.shape[0] // fused_parts // world_size
    blocks = weight.chunk(fused_parts, dim=0)
    return torch.cat([block[rank * width : (rank + 1) * width] for block in blocks]).clone()
    # <<< solution


def row_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``weight`` for a row-parallel layer: the entries that read its
    input features (a copy)."""
    check_divisible(weight.shape[1], "input size", world_size)
    # TODO 2.6: this rank's part of a row-parallel weight.
    # Invariant: the result holds the entries that read this rank's input features; the ranks'
    #   results side by side in rank order give back the whole weight; a copy, not a view.
    # Hint 1: W is [out, in]: which dimension lists the input features?
    # Hint 2: Which dimension do you cut, and which do you keep whole? How wide is one rank's piece,
    #   and where does rank r's start? Should the result share memory with the dense weight?
    # Hint 3: The second dimension, the input features: a [12, 8] weight over 2 ranks gives each
    #   rank a [12, 4] piece.
    # Hint 4: Rank r's piece starts at r times the width and ends before (r + 1) times the width; a
    #   slice is a view of the dense weight, so copy it.
    # Hint 5: All rows, and the columns from rank times width up to (rank + 1) times width, width
    #   being the inputs over world_size; cloned.
    # See guidelines.md#26-tensor-parallelism
    # >>> solution
    width = weight.shape[1] // world_size
    return weight[:, rank * width : (rank + 1) * width].clone()
    # <<< solution


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with y's output features split across the group's ranks.

    The input is replicated on every rank; the output is this rank's slice of y's features, or
    the whole y on every rank when ``gather_output``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        group: Group = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.rank, self.tp_size = tp_rank_and_size(group)
        check_divisible(out_features, "output size", self.tp_size)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.group = group
        local = out_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(local, dtype=dtype, device=device)) if bias else None
        with torch.no_grad():  # each rank draws its own entries: they are different ones anyway
            uniform_like_linear(self.weight, in_features)
            if self.bias is not None:
                uniform_like_linear(self.bias, in_features)

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        group: Group = None,
        *,
        gather_output: bool = False,
        fused_parts: int = 1,
    ) -> ColumnParallelLinear:
        """This rank's shard of a dense layer (copied; ``linear`` is left unchanged)."""
        return cls.from_weights(
            linear.weight,
            linear.bias,
            group,
            gather_output=gather_output,
            fused_parts=fused_parts,
        )

    @classmethod
    def from_weights(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Group = None,
        *,
        gather_output: bool = False,
        fused_parts: int = 1,
    ) -> ColumnParallelLinear:
        """Like :meth:`from_dense`, from a dense [out, in] weight and [out] bias."""
        rank, tp_size = tp_rank_and_size(group)
        check_divisible(weight.shape[0] // fused_parts, "output size", tp_size)
        out_features, in_features = weight.shape
        layer = cls(
            in_features,
            out_features,
            bias is not None,
            gather_output=gather_output,
            group=group,
            dtype=weight.dtype,
            device=weight.device,
        )
        with torch.no_grad():
            layer.weight.copy_(column_shard(weight, rank, tp_size, fused_parts))
            if bias is not None and layer.bias is not None:
                layer.bias.copy_(column_shard(bias, rank, tp_size, fused_parts))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO 2.6: column-parallel forward: this rank's slice of the dense layer's output features.
        # Invariant: the output is this rank's slice of the dense output's features (the whole
        #   output, on every rank, with gather_output); x's gradient is the dense layer's dL/dx on
        #   every rank; the weight and bias shards' gradients are the matching slices of the dense
        #   ones.
        # Hint 1: every rank's output slice is computed from all of x with its own weight rows: how
        #   much of dL/dx does one rank's backward find?
        # Hint 2: Which operator of tensor_parallel_ops.py makes x's gradient whole, and does it go
        #   on x or on the output? What does the local computation need besides this rank's weight
        #   and bias? With gather_output, which operator turns the slice into the whole output?
        #   Which group does each operator get?
        # Hint 3: f goes on the input, before the product: its backward sums the ranks' parts of
        #   dL/dx.
        # Hint 4: Between the operators, an ordinary linear layer on this rank's weight and bias
        #   (F.linear); with gather_output, the gather on its result. Every operator gets
        #   self.group.
        # Hint 5: F.linear of f of x (copy_to_tensor_parallel_region on self.group) with self.weight
        #   and self.bias; when self.gather_output, gather_from_tensor_parallel_region of that on
        #   self.group; return it.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        local_output = F.linear(
            copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias
        )
        if self.gather_output:
            return gather_from_tensor_parallel_region(local_output, self.group)
        return local_output
        # <<< solution

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_features // self.tp_size} on this rank), bias={self.bias is not None}, "
            f"gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with x's input features split across the group's ranks.

    The input is this rank's slice of x's features (``input_is_parallel``, e.g. a column-parallel
    layer's output) or the whole x. The output is the whole y on every rank. The bias is
    replicated: every rank holds all of it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = False,
        group: Group = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.rank, self.tp_size = tp_rank_and_size(group)
        check_divisible(in_features, "input size", self.tp_size)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.group = group
        local = in_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype, device=device))
        # Replicated: it must start equal on every rank, and zeros are (Megatron does the same).
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        )
        with torch.no_grad():
            uniform_like_linear(self.weight, in_features)

    @classmethod
    def from_dense(
        cls, linear: nn.Linear, group: Group = None, *, input_is_parallel: bool = False
    ) -> RowParallelLinear:
        """This rank's shard of a dense layer (copied; ``linear`` is left unchanged)."""
        return cls.from_weights(
            linear.weight, linear.bias, group, input_is_parallel=input_is_parallel
        )

    @classmethod
    def from_weights(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Group = None,
        *,
        input_is_parallel: bool = False,
    ) -> RowParallelLinear:
        """Like :meth:`from_dense`, from a dense [out, in] weight and [out] bias."""
        rank, tp_size = tp_rank_and_size(group)
        out_features, in_features = weight.shape
        layer = cls(
            in_features,
            out_features,
            bias is not None,
            input_is_parallel=input_is_parallel,
            group=group,
            dtype=weight.dtype,
            device=weight.device,
        )
        with torch.no_grad():
            layer.weight.copy_(row_shard(weight, rank, tp_size))
            if bias is not None and layer.bias is not None:
                layer.bias.copy_(bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO 2.6: row-parallel forward: the dense layer's whole output, on every rank.
        # Invariant: the output equals the dense layer's (its bias included once) on every rank; x's
        #   gradient is the dense one (its slice when input_is_parallel); every rank's copy of the
        #   replicated bias gets the dense bias's whole gradient.
        # Hint 1: each rank's product with its weight columns is a partial sum of y. The bias is
        #   whole on every rank: how many times may it end up in y, and which of its copies must
        #   learn?
        # Hint 2: When does x arrive already sliced, and otherwise which operator slices it so that
        #   its gradient comes back whole? Which operator turns the partial sums into y on every
        #   rank? Where does the bias go: into every rank's partial sum, into one rank's, a share of
        #   it into each, or after the sum? For each choice, how many biases does y hold, and what
        #   gradient does each copy get?
        # Hint 3: Unless input_is_parallel, the scatter cuts x (its backward gathers the slices'
        #   gradients into the whole dL/dx); then this rank's product without the bias, and g.
        # Hint 4: The bias goes after g, on every rank: y holds it once and every copy sees the
        #   whole dL/dy. Before g on every rank, y holds n biases; on one rank only, the other
        #   copies get no gradient; a share b/n on each, every copy gets 1/n of its gradient.
        # Hint 5: The scatter of x on self.group unless self.input_is_parallel; F.linear with
        #   self.weight and no bias; g (reduce_from_tensor_parallel_region) of that on self.group;
        #   plus self.bias when there is one.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        output = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.group)
        if self.bias is not None:
            output = output + self.bias
        return output
        # <<< solution

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_features // self.tp_size} on this rank), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}"
        )
