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
from solutions.phase2_advanced.tensor_parallel_ops import (
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
    # Hint 2: How many buffers, of which shape, and which size says how many when the group is a
    #   subgroup of the world? What does an all-gather need of its input's memory? Along which
    #   dimension do the pieces join, and in which order does the all-gather fill the list?
    # Hint 3: the buffers: as many as the group's size (tp_rank_and_size gives it for a subgroup
    #   too), each an empty tensor like the input, which is made contiguous first: the collective
    #   wants contiguous memory.
    # Hint 4: the join: dist.all_gather on the group fills the list in group-rank order; torch.cat
    #   along SEQUENCE_DIM (dimension 1) puts group rank 0's share first.
    # Hint 5: In words: the size from tp_rank_and_size; local made contiguous; that many empty
    #   tensors like it; dist.all_gather into them on the group; their concatenation along dimension
    #   1.
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    # >>> solution
    _, size = tp_rank_and_size(group)
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=SEQUENCE_DIM)
    # <<< solution


def reduce_scatter_sequence(whole: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's share (along dimension 1) of the SUM over the group of every rank's
    ``whole`` (no autograd: the Functions below call it)."""
    check_sequence_share(whole.shape[SEQUENCE_DIM], dist.get_world_size(group))
    # TODO 4.7: this rank's contiguous share of the sequence, summed over the group.
    # Invariant: rank r of a group of n returns tokens [r·L/n, (r+1)·L/n) of the sum of every rank's
    #   input (L the sequence length); the input is left unchanged.
    # Hint 1: torch's reduce-scatter (dist.reduce_scatter_tensor) cuts its input along the FIRST
    #   dimension, and wants contiguous memory; the sequence is dimension 1.
    # Hint 2: reduce_scatter_tensor cuts along dimension 0: how do you bring the sequence there
    #   without changing any value, and what does the collective need of that memory? How many rows
    #   does each rank's output hold? After the collective, which dimension must the sequence be
    #   again? Does anything you do write into the tensor you were handed?
    # Hint 3: the sequence to the front: transpose dimensions 0 and 1 of whole and make the result
    #   contiguous, a new tensor, so the one you were handed stays as it was.
    # Hint 4: the output: L/n rows (that tensor's first dimension divided by the group's size) and
    #   its other dimensions; dist.reduce_scatter_tensor into it on the group leaves this rank's
    #   block of the sum there; transposing dimensions 0 and 1 again puts the sequence back.
    # Hint 5: In words: transpose and make contiguous; a new empty output of one share of the rows;
    #   reduce_scatter_tensor into it on the group; return it transposed back.
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    # >>> solution
    _, size = tp_rank_and_size(group)
    front = whole.transpose(0, SEQUENCE_DIM).contiguous()
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
    dist.reduce_scatter_tensor(out, front, group=group)
    return out.transpose(0, SEQUENCE_DIM)
    # <<< solution


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
    # Hint 2: Without sequence parallelism x is already whole on every rank: what must happen to its
    #   gradient in backward, and which 2.6 operator does exactly that? With it, x holds 1/tp of the
    #   tokens: which of the two Functions above makes them whole in forward, and is its backward
    #   the sum the invariant asks for, in x's shape?
    # Hint 3: without sequence parallelism x is whole already: the forward is the identity, and the
    #   backward must sum every rank's gradient: 2.6's f, copy_to_tensor_parallel_region.
    # Hint 4: with it, GatherSequence: an all-gather along the sequence forward, and backward the
    #   reduce-scatter along it, which gives each rank's share the sum of every rank's gradient for
    #   its tokens: the sum the invariant asks for.
    # Hint 5: In words: with sequence parallelism return GatherSequence applied to x and the group;
    #   without it return copy_to_tensor_parallel_region of x on the group.
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    # >>> solution
    if sequence_parallel:
        return GatherSequence.apply(x, group)
    return copy_to_tensor_parallel_region(x, group)
    # <<< solution


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
    # Hint 2: Without sequence parallelism every rank needs the whole sum: which 2.6 operator gives
    #   it, and what does its backward do? With it, each rank keeps only its share of the summed
    #   tokens, the share its entrance started from: which Function above, and does its backward
    #   hand every partial the gradient of the whole sequence?
    # Hint 3: without sequence parallelism every rank needs the whole sum: 2.6's g,
    #   reduce_from_tensor_parallel_region (all-reduce forward, identity backward: every partial fed
    #   the sum alike).
    # Hint 4: with it, ReduceScatterSequence: a reduce-scatter along the sequence forward (this rank
    #   keeps its share of the summed tokens, the share its entrance started from), and backward the
    #   all-gather, so every partial receives the whole sequence's gradient.
    # Hint 5: In words: with sequence parallelism return ReduceScatterSequence applied to y and the
    #   group; without it return reduce_from_tensor_parallel_region of y on the group.
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    # >>> solution
    if sequence_parallel:
        return ReduceScatterSequence.apply(y, group)
    return reduce_from_tensor_parallel_region(y, group)
    # <<< solution
