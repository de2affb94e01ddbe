"""Exercise 2.6, part 1: the communication of tensor parallelism, as autograd Functions.

Tensor parallelism splits single weight matrices across the ranks of a group. Between the
layers, an activation is *replicated* (the whole tensor on every rank), *sliced* (rank r holds
the r-th equal slice of its last dimension) or *partial* (every rank holds a tensor of the whole
shape, and the true value is their sum). Four operators take an activation from one state to
another, each with the backward that takes its gradient back. Megatron-LM (Shoeybi et al.,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", 2019,
section 3) names the first two f and g:

* f, ``copy_to_tensor_parallel_region``: a replicated activation entering a region where each
  rank uses it with its own slice of the weights; its output is the same values;
* g, ``reduce_from_tensor_parallel_region``: the ranks' partial tensors leaving a region; its
  output is their sum, replicated;
* ``gather_from_tensor_parallel_region``: a sliced activation made whole, replicated;
* ``scatter_to_tensor_parallel_region`` (given): a replicated activation cut into this rank's
  slice.

What each backward must return, and which direction needs the other ranks, is the exercise
(guidelines.md#26-tensor-parallelism asks it). Writing the operators as
``torch.autograd.Function`` lets autograd run the backward; the collectives are plain
``dist.all_reduce`` / ``dist.all_gather`` calls, so tests can count them. Each takes the
tensor-parallel ``group`` (None: the whole world) and communicates inside it only. Megatron's own
versions live in megatron/core/tensor_parallel/mappings.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phase2_advanced.tensor_parallel_support import Group, last_dim_slice, tp_rank_and_size

__all__ = ["Group", "last_dim_slice", "tp_rank_and_size"]  # given, used by the other modules


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's f: a replicated activation entering a region where each rank uses it with its
    own weights."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        # TODO 2.6: f's forward: hand the replicated activation on, as a new tensor.
        # Invariant: the output holds the input's values; the input is left as it was; a collective
        #   only if this direction needs another rank's values.
        # Hint 1: every rank already holds the whole activation. What does this direction need from
        #   the other ranks?
        # Hint 2: Does f's forward need any other rank's values? Why may a Function's forward not
        #   hand back the very tensor object it received (what would autograd attach f's backward
        #   to)? Which kind of tensor is a new object and yet costs no copy?
        # Hint 3: Nothing to communicate: the output's values are the input's, on every rank.
        # Hint 4: A view shares the input's memory and is a new tensor object, so autograd can
        #   attach f's backward to it; a clone would do too, at the price of a copy.
        # Hint 5: Return a view of the input with its own shape (view_as, given the input itself).
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        return tensor.view_as(tensor)
        # <<< solution

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        # TODO 2.6: f's backward: the gradient of f's replicated input.
        # Invariant: every rank returns the same tensor, dL/dx through every rank's use of x (each
        #   rank's weight slice used all of x); grad_output is left as it was; one value per forward
        #   input.
        # Hint 1: after f, each rank multiplies x by its own slice of the weights: how much of dL/dx
        #   can one rank's grad_output hold?
        # Hint 2: Which ranks' grad_output together make dL/dx, and how do their parts combine?
        #   Which collective does that in one call, and on which group? May it write into
        #   grad_output itself (may autograd still hold it; is it contiguous)? How many values must
        #   backward return?
        # Hint 3: dL/dx is the sum of the ranks' grad_output: two ranks holding 1.0 and 3.0 at one
        #   element must both return 4.0 there. One all-reduce (a sum) on the group saved on ctx.
        # Hint 4: The all-reduce writes in place, and grad_output may be shared with autograd or be
        #   an expanded view (the gradient of a sum is one): reduce a contiguous private copy.
        # Hint 5: A contiguous clone of grad_output, all-reduced on the group f saved on ctx,
        #   returned with None for the group.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
        # <<< solution


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: the ranks' partial tensors leaving a region as their sum, replicated."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        # TODO 2.6: g's forward: the sum of the group's partial tensors, on every rank.
        # Invariant: every rank returns the same tensor, the sum over the group of the ranks'
        #   inputs; the input itself is left as it was; one collective.
        # Hint 1: the input is this rank's term of the sum; the sum needs every rank's term.
        # Hint 2: Which collective sums a tensor over the group and leaves the sum on every rank?
        #   Where does it write its result: into a new tensor, or into the one it is handed? Whose
        #   tensor is the input, and who may read it after g? Does the backward need anything saved?
        # Hint 3: One all-reduce (a sum) on the group: two ranks holding 1.0 and 3.0 both return
        #   4.0.
        # Hint 4: The all-reduce must not run in the caller's tensor, which the caller and autograd
        #   may read after g: run it on a contiguous private copy.
        # Hint 5: A contiguous clone of the input, all-reduced on the group, returned. Nothing saved
        #   on ctx.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        total = tensor.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total
        # <<< solution

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        # TODO 2.6: g's backward: the gradient of this rank's term of the sum.
        # Invariant: each rank returns dL/dp for its own term p, given the dL/dy that reached it; a
        #   collective only if that needs another rank's values; one value per forward input.
        # Hint 1: y is replicated and every rank computes the same loss from it: every rank already
        #   holds the whole dL/dy.
        # Hint 2: What is the derivative of a sum with respect to one of its terms? Does this
        #   direction then need any other rank's values? How many values does backward return, and
        #   what for the group?
        # Hint 3: The derivative of p_0 + p_1 + ... with respect to p_r is one, so dL/dp_r is dL/dy.
        # Hint 4: Nothing to communicate: every rank holds dL/dy already. The group gets no
        #   gradient.
        # Hint 5: Return grad_output as it is, and None for the group.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        return grad_output, None
        # <<< solution


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """A sliced activation made whole on every rank, along its last dimension."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        # TODO 2.6: the gather's forward: the ranks' slices side by side, on every rank.
        # Invariant: every rank returns the same tensor, whose last dimension is the group's size
        #   times the input's, holding the group's inputs in group-rank order; one collective; the
        #   input is left as it was.
        # Hint 1: torch's all-gather fills a list of equally shaped buffers, one per rank of the
        #   group.
        # Hint 2: How many buffers, and which size says how many when the group is a subgroup of the
        #   world? What does an all-gather need of its input's memory? Along which dimension do the
        #   gathered pieces go together, and in which order does all-gather fill the list?
        # Hint 3: One buffer per rank of the group: the group's size from tp_rank_and_size, not the
        #   world's (a world of 4 cut into groups of 2 gathers 2 pieces on each rank).
        # Hint 4: all-gather fills the list in group-rank order from contiguous memory; the pieces
        #   joined along the last dimension are the whole tensor.
        # Hint 5: Empty tensors like the contiguous input, one per rank of the group; all-gather
        #   into them on the group; concatenate them along the last dimension.
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
        # TODO 2.6: the gather's backward: the gradient of this rank's slice.
        # Invariant: the result has the input's shape: the part of dL/dy that this rank's input
        #   became; a collective only if that needs another rank's values.
        # Hint 1: every rank holds the whole dL/dy (the output was replicated); only one part of it
        #   came from this rank's input.
        # Hint 2: Which part of dL/dy came from this rank's input: which index and which size decide
        #   it, and of which group, the world or the one saved on ctx? Does this direction need any
        #   other rank's values? May a slice of grad_output be handed back as it is?
        # Hint 3: The index and the size are this rank's in the group saved on ctx: in the group of
        #   global ranks 2 and 3, global rank 3 takes slice 1 of 2.
        # Hint 4: No communication: the slice is already here. last_dim_slice cuts it as a view;
        #   hand back a contiguous copy.
        # Hint 5: tp_rank_and_size of the group saved on ctx; that rank's last_dim_slice of
        #   grad_output for that size, made contiguous; None for the group.
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        rank, world_size = tp_rank_and_size(ctx.group)
        return last_dim_slice(grad_output, rank, world_size).contiguous(), None
        # <<< solution


class ScatterToTensorParallelRegion(torch.autograd.Function):
    """A replicated activation cut into this rank's slice of its last dimension (given)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        rank, world_size = tp_rank_and_size(group)
        return last_dim_slice(tensor, rank, world_size).contiguous()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return GatherFromTensorParallelRegion.apply(grad_output, ctx.group), None


def copy_to_tensor_parallel_region(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """f (:class:`CopyToTensorParallelRegion`) on ``group``."""
    return CopyToTensorParallelRegion.apply(tensor, group)


def reduce_from_tensor_parallel_region(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """g (:class:`ReduceFromTensorParallelRegion`) on ``group``."""
    return ReduceFromTensorParallelRegion.apply(tensor, group)


def gather_from_tensor_parallel_region(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """The gather (:class:`GatherFromTensorParallelRegion`) on ``group``."""
    return GatherFromTensorParallelRegion.apply(tensor, group)


def scatter_to_tensor_parallel_region(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """The scatter (:class:`ScatterToTensorParallelRegion`) on ``group``."""
    return ScatterToTensorParallelRegion.apply(tensor, group)
