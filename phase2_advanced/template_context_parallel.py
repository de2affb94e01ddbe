# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase2.py
"""Exercise 2.7, part 2: ring attention, forward and backward, as an autograd Function.

Each rank of the context-parallel ``group`` holds the q, k and v of its own positions (its
chunks, see context_parallel_layout.py). Attention needs every query to meet every key, so the
key/value blocks travel around the ring; after cp steps every block has visited every rank,
and each rank has seen all keys without ever holding more than two K/V blocks (Liu, Zaharia,
Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context", 2023)::

    step 0          step 1          step 2            at each step, every rank computes its
    r0: kv0         r0: kv2         r0: kv1           queries against the block it holds and
    r1: kv1   -->   r1: kv0   -->   r1: kv2           passes that block on to the next rank
    r2: kv2         r2: kv1         r2: kv0           while it computes

**Merging partial results.** A query's attention over all keys is never computed in one piece:
each step gives it the output over one block's keys, with that block's log-sum-exp (lse). Two
such partial results over disjoint key sets combine exactly into the result over both (the
online softmax of Milakov and Gimelshein, 2018, which FlashAttention and ring attention use):
:func:`merge_partials`, which must stay finite where a naive combination overflows.

**Backward.** A second ring. The gradient of each block needs the queries' *final* output and
lse (saved by the forward) and the block's K/V. The dQ of a rank's queries sums the shares of
every block they met; the dK and dV of a rank's own K/V sum the shares of every rank's queries,
and must end on that rank. How they get there is the exercise.

Every function takes the context-parallel ``group`` (None: the world); ranks and sizes are
``dist.get_rank(group)`` and ``dist.get_world_size(group)``. Blocks come from
ring_attention_blocks.py (given); which blocks a rank computes comes from your
``block_kind``; ``zigzag`` says which layout the local tensors are in.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phase2_advanced.ring_attention_blocks import (
    BlockKind,
    Group,
    block_attention,
    block_attention_backward,
    check_ring_inputs,
    chunk_count,
    default_scale,
    start_ring_pass,
)
from phase2_advanced.template_context_parallel_layout import block_kind, chunk_ids


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over key set A (``out_a`` [B, H, L, d], ``lse_a`` [B, H, L]) and over a
    disjoint key set B into attention over A and B together: ``(out, lse)``, same shapes."""
    # TODO 2.7: merge two partial attention results over disjoint key sets
    # Invariant: the result is attention over both key sets at once (the out and lse that
    #   block_attention would return for the union); it stays finite and exact for any finite
    #   lse (hundreds, in float32 too); merging (a, b) or (b, a) gives the same.
    # Hint 1: each partial result is a ratio, and its lse gives back that ratio's denominator
    #   (the guide writes out_A and lse_A). Write the union's numerator and denominator from the
    #   two partial results, then make them safe to compute.
    # More hints: uv run python -m tests.hint 2.7
    # See guidelines.md#27-context-parallelism
    raise NotImplementedError(
        "TODO 2.7: merge two partial attention results over disjoint key sets "
        "(see phase2_advanced/guidelines.md#27-context-parallelism)"
    )


def ring_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    causal: bool,
    zigzag: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output (in q's dtype) and lse [B, H, local length], over the keys of
    every rank of ``group``, by passing K/V blocks around the ring."""
    # TODO 2.7: the forward ring loop: each local query chunk meets every key chunk once
    # Invariant: every local query chunk merges exactly the blocks block_kind asks for, from
    #   every rank's K/V, each computed once; returns (out in q's dtype, lse in the
    #   accumulation dtype) over every key of the sequence; the transfers hide behind the
    #   compute: every block is computed while a ring pass is in flight, except on the last
    #   step, which passes nothing; cp - 1 passes in all.
    # Hint 1: the queries stay and the K/V blocks move; the guide's step table shows which
    #   block each rank holds at each step.
    # More hints: uv run python -m tests.hint 2.7
    # See guidelines.md#27-context-parallelism
    raise NotImplementedError(
        "TODO 2.7: the forward ring loop: each local query chunk meets every key chunk once "
        "(see phase2_advanced/guidelines.md#27-context-parallelism)"
    )


def ring_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group: Group,
    *,
    causal: bool,
    zigzag: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dL/dq, dL/dk, dL/dv of this rank's local q, k, v (in their dtypes), given dL/d``out`` and
    the forward's ``out`` and ``lse``, by a second ring over ``group``."""
    # TODO 2.7: the backward ring loop: every share of dQ, dK and dV reaches its owner
    # Invariant: dq sums the shares of every block this rank's queries met; dk and dv sum the
    #   shares of every rank's queries in this rank's K/V; all three are accumulated in lse's
    #   dtype and returned in the dtypes of q, k and v; every block is computed with the K/V of
    #   its own step and the saved final out and lse; this rank sends 2(cp − 1) times the bytes
    #   of its K and V in all, no more.
    # Hint 1: the K/V blocks visit every rank again, as in the forward. A block's dQ share
    #   belongs to the queries here; its dK/dV share belongs to the block's home rank.
    # More hints: uv run python -m tests.hint 2.7
    # See guidelines.md#27-context-parallelism
    raise NotImplementedError(
        "TODO 2.7: the backward ring loop: every share of dQ, dK and dV reaches its owner "
        "(see phase2_advanced/guidelines.md#27-context-parallelism)"
    )


class RingAttention(torch.autograd.Function):
    """Ring attention with a hand-written backward: the forward's ring cannot be differentiated
    by autograd (its sends and receives are not operations on the graph), so the Function saves
    q, k, v, the output and the lse, and runs a second ring in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: Group,
        causal: bool,
        zigzag: bool,
        scale: float,
    ) -> torch.Tensor:
        out, lse = ring_attention_forward(q, k, v, group, causal=causal, zigzag=zigzag, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (group, causal, zigzag, scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, zigzag, scale = ctx.settings
        dq, dk, dv = ring_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, group,
            causal=causal, zigzag=zigzag, scale=scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group = None,
    *,
    causal: bool = False,
    zigzag: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Self-attention over the whole sequence, from this rank's local q, k, v [B, H, local, d].

    The local tensors are this rank's chunks of the sequence in the layout ``zigzag`` names
    (shard them with ``shard_sequence``); the result is this rank's rows of what
    ``scaled_dot_product_attention(q, k, v, is_causal=causal)`` gives on the whole sequence,
    and it is differentiable. ``scale`` defaults to 1/sqrt(d).
    """
    cp = dist.get_world_size(group)
    check_ring_inputs(q, k, v, chunk_count(cp, zigzag) // cp)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    result = RingAttention.apply(q, k, v, group, causal, zigzag, scale)
    assert isinstance(result, torch.Tensor)
    return result
