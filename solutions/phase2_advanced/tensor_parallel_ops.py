"""Exercise 2.6, part 1: the communication of tensor parallelism, as autograd Functions.

Tensor parallelism splits single weight matrices across ranks. Every rank then holds a *slice*
of an activation, or a *partial sum* of it, and the layers need four conversions between the
"replicated", "sliced" and "partial" states, each with a matching backward. Megatron-LM (Shoeybi
et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism",
2019, section 3) names the first two f and g::

    operator                          forward                       backward
    f  copy_to_tensor_parallel_region identity                      all-reduce (sum)
    g  reduce_from_..._region         all-reduce (sum)              identity
       gather_from_..._region         all-gather along last dim     keep this rank's slice
       scatter_to_..._region          keep this rank's slice        all-gather along last dim

Each pair is the transpose of the other: if the forward of y = op(x) sends x's pieces to every
rank, the backward must collect every rank's contribution to dL/dx. f sits where a replicated
activation enters a column-parallel layer: each rank's slice of the layer uses all of x, so dL/dx
is the *sum* of every rank's contribution. g sits where a row-parallel layer's partial sums leave:
the sum is replicated, and its gradient already is too.

Writing them as ``torch.autograd.Function`` lets autograd call the right collective in backward;
the collectives are plain ``dist.all_reduce`` / ``dist.all_gather`` calls, so tests can count them.
Each takes the tensor-parallel ``group`` (None: the whole world) and communicates inside it only:
ranks and sizes are ``dist.get_rank(group)`` and ``dist.get_world_size(group)``, and every
collective gets ``group=``. Megatron's own versions live in
megatron/core/tensor_parallel/mappings.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phase2_advanced.tensor_parallel_support import Group, last_dim_slice, tp_rank_and_size

__all__ = ["Group", "last_dim_slice", "tp_rank_and_size"]  # given, used by the other modules


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce (sum) of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        # TODO 2.6: f's forward: pass the replicated activation through unchanged.
        # Invariant: the output has the input's values; no communication in forward.
        # Hint 1: every rank already holds the whole activation; autograd still needs a new
        #   output tensor to attach this Function's backward to.
        # Hint 2: Why may a Function's forward not simply hand back the very tensor object it
        #   received (what would autograd attach this Function's backward to)? What kind of tensor
        #   is a new object but costs no copy?
        # Hint 3: Return a view of the whole input with its own shape (view_as with the input
        #   itself): the same memory, a new tensor object for autograd.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        return tensor.view_as(tensor)
        # <<< solution

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        # TODO 2.6: f's backward: sum the gradient over the tensor-parallel group.
        # Invariant: every rank returns the same tensor: the sum of all ranks' grad_output
        #   (each rank's weight slice contributed its own part of dL/dx); one all-reduce.
        # Hint 1: all-reduce works in place, and grad_output may be shared with autograd or not
        #   contiguous. backward returns one gradient per forward input, the group included.
        # Hint 2: Each rank's weight slice produced its own part of dL/dx: what combines them? Can
        #   the all-reduce write into grad_output itself (may autograd still hold it; is it
        #   contiguous)? Which group: where did forward leave it? How many values must backward
        #   return?
        # Hint 3: A contiguous private copy of grad_output, one all-reduce of it on the group saved
        #   on ctx (the sum), and the pair (that copy, no gradient for the group).
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
        # <<< solution


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: all-reduce (sum) in forward, identity in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        # TODO 2.6: g's forward: sum the partial results of all ranks.
        # Invariant: every rank returns the same tensor, the sum of all ranks' inputs; the
        #   input itself is not modified; one all-reduce.
        # Hint 1: all-reduce works in place: the caller's tensor must stay intact.
        # Hint 2: An all-reduce writes its result into the tensor it is given: whose tensor would
        #   that be if you handed it the input? What must be true of the memory a collective works
        #   on? Does the backward need anything remembered?
        # Hint 3: A contiguous private copy of the input and one all-reduce of it on the group;
        #   return the copy. Nothing to remember on ctx: the backward needs nothing.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        total = tensor.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total
        # <<< solution

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        # TODO 2.6: g's backward: the gradient of a replicated sum is the same on every rank.
        # Invariant: no communication; each partial input gets the full output gradient,
        #   since d(sum_r p_r)/d p_r = 1.
        # Hint 1: nothing to reduce: every rank already holds dL/dy.
        # Hint 2: One gradient per forward input, in order: the tensor's and the group's. What is
        #   the derivative of a sum with respect to one of its terms?
        # Hint 3: Return grad_output as it is for the tensor, and None for the group: every partial
        #   fed the sum with weight one.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        return grad_output, None
        # <<< solution


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather of the last dimension in forward; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        # TODO 2.6: concatenate every rank's slice along the last dimension, in rank order.
        # Invariant: every rank returns the same tensor, whose last dimension is world_size
        #   times the input's, holding the ranks' inputs side by side in group-rank order.
        # Hint 1: torch's all-gather fills a list of equally shaped buffers, one per rank.
        # Hint 2: How many buffers, and which size says how many when the group is a subgroup of the
        #   world? What does an all-gather need of its input's memory? Along which dimension do the
        #   gathered pieces go together, and in what order does all-gather fill the list?
        # Hint 3: The group's size (tp_rank_and_size) says how many buffers; each an empty tensor
        #   like the contiguous input; all-gather on the group fills them in group-rank order;
        #   concatenate them along the last dimension.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        _, world_size = tp_rank_and_size(group)
        local = tensor.contiguous()
        parts = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=-1)
        # <<< solution

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        # TODO 2.6: the gradient of this rank's input is its own slice of the output gradient.
        # Invariant: no communication; the result has the input's shape.
        # Hint 1: every rank holds the full dL/dy (the output was replicated); only the part
        #   that came from this rank's input belongs to it.
        # Hint 2: Which part of dL/dy came from this rank's input: which index and which size decide
        #   it, and of which group (the world's, or the one saved on ctx)? Is a slice of grad_output
        #   something you may hand back as it is?
        # Hint 3: This rank's index and the size of the group saved on ctx (not of the world) pick
        #   the slice; last_dim_slice cuts it; return a contiguous copy and None.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        rank, world_size = tp_rank_and_size(ctx.group)
        return last_dim_slice(grad_output, rank, world_size).contiguous(), None
        # <<< solution


class ScatterToTensorParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension in forward; all-gather in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        rank, world_size = tp_rank_and_size(group)
        return last_dim_slice(tensor, rank, world_size).contiguous()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        # The transpose of the forward slice: gather every rank's slice of the gradient.
        return GatherFromTensorParallelRegion.apply(grad_output, ctx.group), None


def copy_to_tensor_parallel_region(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """f: identity forward, all-reduce backward (where a replicated input enters the layer)."""
    return CopyToTensorParallelRegion.apply(tensor, group)


def reduce_from_tensor_parallel_region(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """g: all-reduce forward, identity backward (where partial sums leave the layer)."""
    return ReduceFromTensorParallelRegion.apply(tensor, group)


def gather_from_tensor_parallel_region(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """All-gather the last dimension; backward keeps this rank's slice."""
    return GatherFromTensorParallelRegion.apply(tensor, group)


def scatter_to_tensor_parallel_region(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; backward all-gathers."""
    return ScatterToTensorParallelRegion.apply(tensor, group)
