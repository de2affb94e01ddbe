# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase4.py
"""Exercise 4.7, sequence parallelism: where tensor parallelism's regions begin and end.

Tensor parallelism (2.6) keeps the activations *between* its regions whole on every rank of the
tp group: each rank computes the same RMSNorm, residual add and dropout on the same tokens, and
holds the same [batch, tokens, width] activations: tp times the memory and the work those
element-wise layers need. Sequence parallelism (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022, section 4.2.2; Megatron-LM's
``--sequence-parallel``) cuts those activations along the *sequence* instead: each tp rank holds
and computes 1/tp of the tokens there. The two kinds of region meet with two collectives that
replace tensor parallelism's f and g, at the same total cost::

    without SP:  x (whole) --f--> [column ... row] --g--> x (whole)
    with SP:     x (1/tp of the tokens) --all-gather--> [column ... row] --reduce-scatter--> x

A ring all-reduce *is* a reduce-scatter followed by an all-gather (3.1), so g = reduce-scatter
then all-gather: SP stops g halfway and keeps only its own tokens, and moves the all-gather to the
next region's entrance. The same bytes, and the activations between regions shrink tp times.

Both collectives are autograd Functions, each other's transpose: the backward of an all-gather
along the sequence is a reduce-scatter along the sequence (every rank's slice of the output
contributed to every rank's gradient), and the other way round. Activations here are
[batch, tokens, width]; the sequence is dimension 1, and every rank of the group holds an equal,
contiguous share of it, in group-rank order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phase2_advanced.tensor_parallel_support import Group, tp_rank_and_size
from phase4_production.lm_support import check_sequence_share
from phase2_advanced.template_tensor_parallel_ops import (
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)

SEQUENCE_DIM = 1


def all_gather_sequence(local: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's share of the sequence, concatenated along dimension 1 in group-rank order
    (no autograd: the Functions below call it)."""
    # TODO 4.7: the whole sequence from every rank's contiguous share of it.
    # Invariant: every rank returns the same tensor: the group's shares side by side along the
    #   sequence (dimension 1), group rank 0's first; its other dimensions are the input's.
    # Hint 1: torch's all-gather fills one equally shaped buffer per rank (the group's size); the
    #   sequence is not the first dimension.
    # More hints: uv run python -m tests.hint 4.7
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    raise NotImplementedError(
        "TODO 4.7: the whole sequence from every rank's contiguous share of it "
        "(see phase4_production/guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis)"
    )


def reduce_scatter_sequence(whole: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's share (along dimension 1) of the SUM over the group of every rank's
    ``whole`` (no autograd: the Functions below call it)."""
    check_sequence_share(whole.shape[SEQUENCE_DIM], dist.get_world_size(group))
    # TODO 4.7: this rank's contiguous share of the sequence, summed over the group.
    # Invariant: rank r of a group of n returns tokens [r·L/n, (r+1)·L/n) of the sum of every rank's
    #   input (L the sequence length); the input is left unchanged.
    # Hint 1: torch's reduce-scatter (dist.reduce_scatter_tensor) cuts its input along the FIRST
    #   dimension, and wants contiguous memory; the sequence is dimension 1.
    # More hints: uv run python -m tests.hint 4.7
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    raise NotImplementedError(
        "TODO 4.7: this rank's contiguous share of the sequence, summed over the group "
        "(see phase4_production/guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis)"
    )


class GatherSequence(torch.autograd.Function):
    """All-gather along the sequence in forward, reduce-scatter along it in backward."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_gather_sequence(local, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # every rank's whole output used this rank's share: its gradient sums all of theirs
        return reduce_scatter_sequence(grad, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence in forward, all-gather along it in backward."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_sequence(partial, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # each rank's partial sum fed every share: its gradient is every share's gradient
        return all_gather_sequence(grad, ctx.group), None


def enter_tensor_parallel(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """What a column-parallel layer's input must be: ``x`` as it arrives from the region before
    (whole on every tp rank without sequence parallelism, this rank's share of the tokens
    with it), turned into the whole sequence that every rank's slice of the layer needs."""
    # TODO 4.7: the entrance of a tensor-parallel region, with and without sequence parallelism.
    # Invariant: the result holds every token of the sequence on every rank of the group; in
    #   backward, the gradient that reaches x is the SUM over the group of every rank's contribution
    #   (each rank's weight slice used all of x), in the form x came in (whole, or this rank's share
    #   of the tokens).
    # Hint 1: ask what x holds when it arrives (every token, or 1/tp of them) and what the gradient
    #   on the way back must be: a sum over the group, in the form x came in.
    # More hints: uv run python -m tests.hint 4.7
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    raise NotImplementedError(
        "TODO 4.7: the entrance of a tensor-parallel region, with and without sequence parallelism "
        "(see phase4_production/guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis)"
    )


def leave_tensor_parallel(y: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """What a row-parallel layer's partial sums become for the region after it: the sum over
    the group, whole on every rank without sequence parallelism, this rank's share of the
    tokens with it."""
    # TODO 4.7: the exit of a tensor-parallel region, with and without sequence parallelism.
    # Invariant: the result is the sum over the group of every rank's partial y (all tokens, or this
    #   rank's contiguous share of them with sequence parallelism: the same share the region's
    #   entrance started from); in backward every rank's partial receives the gradient of the whole
    #   sequence.
    # Hint 1: the exit undoes the entrance: ask what each rank must hold after it (the whole sum, or
    #   its share of the summed tokens) and what gradient each rank's partial sum receives.
    # More hints: uv run python -m tests.hint 4.7
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    raise NotImplementedError(
        "TODO 4.7: the exit of a tensor-parallel region, with and without sequence parallelism "
        "(see phase4_production/guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis)"
    )
