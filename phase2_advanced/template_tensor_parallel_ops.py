# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase2.py
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
        # More hints: uv run python -m tests.hint 2.6
        # See guidelines.md#26-tensor-parallelism
        raise NotImplementedError(
            "TODO 2.6: f's forward: hand the replicated activation on, as a new tensor "
            "(see phase2_advanced/guidelines.md#26-tensor-parallelism)"
        )

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        # TODO 2.6: f's backward: the gradient of f's replicated input.
        # Invariant: every rank returns the same tensor, dL/dx through every rank's use of x (each
        #   rank's weight slice used all of x); grad_output is left as it was; one value per forward
        #   input.
        # Hint 1: after f, each rank multiplies x by its own slice of the weights: how much of dL/dx
        #   can one rank's grad_output hold?
        # More hints: uv run python -m tests.hint 2.6
        # See guidelines.md#26-tensor-parallelism
        raise NotImplementedError(
            "TODO 2.6: f's backward: the gradient of f's replicated input "
            "(see phase2_advanced/guidelines.md#26-tensor-parallelism)"
        )


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: the ranks' partial tensors leaving a region as their sum, replicated."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        # TODO 2.6: g's forward: the sum of the group's partial tensors, on every rank.
        # Invariant: every rank returns the same tensor, the sum over the group of the ranks'
        #   inputs; the input itself is left as it was; one collective.
        # Hint 1: the input is this rank's term of the sum; the sum needs every rank's term.
        # More hints: uv run python -m tests.hint 2.6
        # See guidelines.md#26-tensor-parallelism
        raise NotImplementedError(
            "TODO 2.6: g's forward: the sum of the group's partial tensors, on every rank "
            "(see phase2_advanced/guidelines.md#26-tensor-parallelism)"
        )

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        # TODO 2.6: g's backward: the gradient of this rank's term of the sum.
        # Invariant: each rank returns dL/dp for its own term p, given the dL/dy that reached it; a
        #   collective only if that needs another rank's values; one value per forward input.
        # Hint 1: y is replicated and every rank computes the same loss from it: every rank already
        #   holds the whole dL/dy.
        # More hints: uv run python -m tests.hint 2.6
        # See guidelines.md#26-tensor-parallelism
        raise NotImplementedError(
            "TODO 2.6: g's backward: the gradient of this rank's term of the sum "
            "(see phase2_advanced/guidelines.md#26-tensor-parallelism)"
        )


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
        # More hints: uv run python -m tests.hint 2.6
        # See guidelines.md#26-tensor-parallelism
        raise NotImplementedError(
            "TODO 2.6: the gather's forward: the ranks' slices side by side, on every rank "
            "(see phase2_advanced/guidelines.md#26-tensor-parallelism)"
        )

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        # TODO 2.6: the gather's backward: the gradient of this rank's slice.
        # Invariant: the result has the input's shape: the part of dL/dy that this rank's input
        #   became; a collective only if that needs another rank's values.
        # Hint 1: every rank holds the whole dL/dy (the output was replicated); only one part of it
        #   came from this rank's input.
        # More hints: uv run python -m tests.hint 2.6
        # See guidelines.md#26-tensor-parallelism
        raise NotImplementedError(
            "TODO 2.6: the gather's backward: the gradient of this rank's slice "
            "(see phase2_advanced/guidelines.md#26-tensor-parallelism)"
        )


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
