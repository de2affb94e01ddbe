"""Exercise 2.6, part 2: column- and row-parallel linear layers (Megatron-LM, section 3).

A linear layer computes ``y = x W^T + b`` with ``W`` of shape [out, in]. Its weight can be split
across n ranks in two ways, and each needs different communication::

    column-parallel: split W's rows (output features)   row-parallel: split W's columns (inputs)

      x (replicated) --f--> x W_r^T + b_r = y_r            x_r (sliced) --> x_r W_r^T = p_r
      rank r holds out/n of y's features                   rank r holds a partial sum of all of y
      gather_output: all-gather y_r -> y                   g sums the p_r: y, on every rank

Column then row, with no communication between them, is Megatron's MLP: the column layer's
output slice is exactly the row layer's input slice, so the pair costs one all-reduce in forward
(g) and one in backward (f).

The bias of a row-parallel layer is replicated on every rank, and where it enters decides both
the output (how many biases it holds) and which copies learn: guidelines.md#26-tensor-parallelism
("The bias") works through the choices.

Both layers are built from a dense ``nn.Linear`` (``from_dense``) so that tests and the demo can
compare them with it. Every layer works on its tensor-parallel ``group`` (None: the whole world):
the shard it holds is picked by ``dist.get_rank(group)``, and its collectives stay in the group.
PyTorch's counterparts are ``ColwiseParallel`` / ``RowwiseParallel`` in
``torch.distributed.tensor.parallel`` (see library/tensor_parallel.py).
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
    """Rank ``rank``'s rows of ``weight`` (or entries of a bias) for a column-parallel layer.

    ``fused_parts`` > 1 says that the output features are that many equal matrices stacked (a
    fused QKV projection: [q; k; v]); the rank then takes its slice of *each* part, so it gets
    the q, k and v of the same heads. Returns a copy.
    """
    if weight.shape[0] % fused_parts:
        raise ValueError(
            f"{weight.shape[0]} output features cannot be {fused_parts} equal fused parts"
        )
    check_divisible(weight.shape[0] // fused_parts, "output size", world_size)
    # TODO 2.6: take this rank's equal slice of dim 0, from each of the fused_parts blocks.
    # Invariant: result.shape[0] == weight.shape[0] // world_size; the ranks' results, put
    #   side by side in rank order within each part, give back every row of the part.
    # Hint 1: with fused_parts > 1 the rows are that many stacked matrices, and each of them is
    #   split among the ranks on its own (the guide's q/k/v picture); with 1 part it is one
    #   equal slice of the rows per rank.
    # Hint 2: the width of one rank's slice of one block; the blocks of the weight along its
    #   first dimension; from each block, the rows of this rank; the pieces concatenated in
    #   block order, as a copy (not a view of weight).
    # Hint 3: width = rows / fused_parts / world_size (integer division); the blocks are
    #   weight chunked into fused_parts along dim 0; from each block, rows rank·width up to
    #   (rank + 1)·width; torch.cat of those pieces, then clone.
    # See guidelines.md#26-tensor-parallelism
    # >>> solution
    width = weight.shape[0] // fused_parts // world_size
    blocks = weight.chunk(fused_parts, dim=0)
    return torch.cat([block[rank * width : (rank + 1) * width] for block in blocks]).clone()
    # <<< solution


def row_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s columns (input features) of ``weight`` for a row-parallel layer (a copy)."""
    check_divisible(weight.shape[1], "input size", world_size)
    # TODO 2.6: take this rank's equal slice of the weight's input dimension (dim 1).
    # Invariant: result.shape == (out, in // world_size); the ranks' results side by side in
    #   rank order give back the whole weight.
    # Hint 1: the input features of a row-parallel layer are split, and W is [out, in].
    # Hint 2: In a weight of shape [out, in], which dimension lists the input features? How wide is
    #   one rank's piece, and where does rank r's start? Should the result share memory with the
    #   dense weight?
    # Hint 3: The same cut as column_shard's with one block, on the second dimension: width = in
    #   divided by world_size; all rows, columns from rank x width up to (rank + 1) x width, as a
    #   copy (clone).
    # See guidelines.md#26-tensor-parallelism
    # >>> solution
    width = weight.shape[1] // world_size
    return weight[:, rank * width : (rank + 1) * width].clone()
    # <<< solution


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's rows (output features) split across the group's ranks.

    The input is replicated on every rank; the output is this rank's slice of y's features, or
    the whole y when ``gather_output`` (an all-gather in forward, a slice in backward).
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
        with torch.no_grad():  # each rank draws its own rows: they are different rows anyway
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
        # TODO 2.6: column-parallel forward: f, this rank's slice of the linear, maybe gather.
        # Invariant: output == this rank's slice of the dense output's features (all of them
        #   with gather_output); in backward, dL/dx is summed over ranks (f does it).
        # Hint 1: the operators of tensor_parallel_ops.py put the communication where it
        #   belongs; between them, an ordinary linear layer on this rank's weight and bias.
        # Hint 2: three stages, each given self.group: f on the input, the local linear with
        #   this rank's weight and bias, and the gather only when self.gather_output.
        # Hint 3: copy_to_tensor_parallel_region (f) of the input on self.group; F.linear of
        #   that with self.weight and self.bias; gather_from_tensor_parallel_region of the
        #   result on self.group when gather_output is set.
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
    """``y = x W^T + b`` with W's columns (input features) split across the group's ranks.

    The input is this rank's slice of x's features (``input_is_parallel``, e.g. a column-parallel
    layer's output) or the whole x, which is then sliced here. Each rank computes a partial sum,
    g all-reduces it, and the bias is replicated on every rank.
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
        # TODO 2.6: row-parallel forward: maybe slice x, local product, g, then the bias once.
        # Invariant: output == the dense layer's output on every rank, with exactly one bias;
        #   every rank's bias receives the same (full) gradient; one all-reduce in forward.
        # Hint 1: each rank's product is a partial sum of the output, g adds them up, and the
        #   replicated bias must be counted once: the guide's "The bias: once, after the
        #   reduction" says where it goes.
        # Hint 2: four stages, each given self.group where it communicates: the scatter only
        #   when the input is not already split; the local linear WITHOUT bias; g; then the
        #   whole bias (when there is one) added to g's output.
        # Hint 3: scatter_to_tensor_parallel_region of the input on self.group, unless
        #   input_is_parallel; F.linear with self.weight and no bias; its
        #   reduce_from_tensor_parallel_region (g) on self.group; plus self.bias if it exists.
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
