"""Exercise 2.7, part 2: ring attention, forward and backward, as an autograd Function.

Each rank of the context-parallel ``group`` holds the q, k and v of its own positions (its
chunks, see context_parallel_layout.py). Attention needs every query to meet every key, so the
key/value blocks travel around the ring: at step s, rank r holds the K/V block that started on
the rank s places behind it; after cp steps every block has visited every rank, and each rank
has seen all keys without ever holding more than two K/V blocks (Liu, Zaharia, Abbeel, "Ring
Attention with Blockwise Transformers for Near-Infinite Context", 2023)::

    step 0          step 1          step 2            at each step, every rank computes its
    r0: kv0         r0: kv2         r0: kv1           queries against the block it holds and
    r1: kv1   -->   r1: kv0   -->   r1: kv2           passes that block on to the next rank
    r2: kv2         r2: kv1         r2: kv0           while it computes

**Merging partial results.** A query's attention over all keys is never computed in one piece:
each step gives it the output over one block's keys, with that block's log-sum-exp (lse). Two
such partial results over disjoint key sets combine exactly into the result over both (the
online softmax of Milakov and Gimelshein, 2018, which FlashAttention and ring attention use):
:func:`merge_partials`. Written naively the combination overflows; the guide derives the form
that does not.

**Backward.** The gradient of each block needs the queries' *final* output and lse (saved by
the forward) and the block's K/V. dQ stays on its rank and sums the contributions of every
block. dK and dV belong to the block's home rank, but are computed on every rank the block
visits: they travel around the ring with their block, collecting each rank's share, and the
sum comes home at the end.

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
from solutions.phase2_advanced.context_parallel_layout import block_kind, chunk_ids


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over key set A (``out_a`` [B, H, L, d], ``lse_a`` [B, H, L]) and over a
    disjoint key set B into attention over A and B together: ``(out, lse)``, same shapes."""
    # TODO 2.7: merge two partial attention results over disjoint key sets
    # Invariant: the result is attention over both key sets at once: lse is the log of the two
    #   sets' summed exponentials, out the mix of out_a and out_b weighted by each set's share
    #   of that sum; nothing is exponentiated that can overflow, so it stays finite and exact
    #   for any finite lse (hundreds, in float32 too); merging (a, b) or (b, a) is the same.
    # Hint 1: out_a is (sum over A of exp(score) * v) / exp(lse_a). Write the numerator and the
    #   denominator of the union from the two partial results, then factor out the larger of
    #   the two exponentials before computing anything (the guide derives it).
    # Hint 2: take the element-wise larger lse; exponentiate each lse minus it (one weight is
    #   1, the other at most 1); the new lse is that maximum plus the log of the summed
    #   weights; the new out is each out times its weight over the summed weights (the
    #   weights need a trailing dimension to broadcast over head_dim).
    # Hint 3: m = the element-wise maximum of lse_a and lse_b (torch.maximum);
    #   w_a = exp(lse_a − m), w_b = exp(lse_b − m); lse = m + log(w_a + w_b);
    #   out = (w_a·out_a + w_b·out_b) / (w_a + w_b), every weight given a last dimension of
    #   size 1 (unsqueeze) so that it broadcasts over head_dim.
    # See guidelines.md#27-context-parallelism
    # >>> solution
    largest = torch.maximum(lse_a, lse_b)
    weight_a = torch.exp(lse_a - largest)
    weight_b = torch.exp(lse_b - largest)
    total = weight_a + weight_b  # in [1, 2]: no overflow, no division by ~0
    out = (weight_a.unsqueeze(-1) * out_a + weight_b.unsqueeze(-1) * out_b) / total.unsqueeze(-1)
    return out, largest + torch.log(total)
    # <<< solution


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
    # Invariant: after cp steps, every local query chunk has merged exactly the blocks
    #   block_kind asks for, from every rank, each computed once; at each step but the last,
    #   the K/V block this rank holds is passed on (start_ring_pass) BEFORE it computes on it,
    #   and the next block is waited for only after: cp - 1 passes in all.
    # Hint 1: at step s this rank holds the block that started on the rank s places behind it
    #   in the ring (chunk_ids of that rank says which chunks the block holds); the block is
    #   its local k and v, cut into chunks the same way.
    # Hint 2: cut the local q into its chunks and keep one (out, lse) per query chunk, empty
    #   at first. Each step: post the pass of the current K/V unless it is the last step;
    #   find the source rank and its chunk ids; cut the block into chunks; for each (query
    #   chunk, key chunk) pair ask block_kind, skip or compute block_attention (the mask only
    #   on the diagonal) and merge the result into that query chunk's (out, lse) (the first one
    #   is taken as it is); wait for the pass and make what arrived the current block. Return
    #   the outputs (in q's dtype) and the lse, concatenated back along the sequence.
    # Hint 3: the visiting block's home is rank − step (mod cp); chunk q (and each block's k
    #   and v) along dim 2 into as many pieces as the rank holds chunks; the pass takes the
    #   pair [k, v] of the block held now and its wait() gives the next pair; at the end,
    #   torch.cat along dim 2 of the outs (cast to q's dtype) and of the lses (left in the
    #   accumulation dtype, as the guide's "Which dtype" says).
    # See guidelines.md#27-context-parallelism
    # >>> solution
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    mine = chunk_ids(rank, cp, zigzag=zigzag)
    q_chunks = q.chunk(len(mine), dim=2)
    outs: list[torch.Tensor | None] = [None] * len(mine)
    lses: list[torch.Tensor | None] = [None] * len(mine)
    k_block, v_block = k, v
    for step in range(cp):
        pending = start_ring_pass([k_block, v_block], group) if step < cp - 1 else None
        theirs = chunk_ids((rank - step) % cp, cp, zigzag=zigzag)  # the block's home rank
        k_chunks, v_chunks = k_block.chunk(len(theirs), dim=2), v_block.chunk(len(theirs), dim=2)
        for a, q_id in enumerate(mine):
            for b, k_id in enumerate(theirs):
                kind = block_kind(q_id, k_id, causal=causal)
                if kind is BlockKind.SKIP:
                    continue
                out, lse = block_attention(
                    q_chunks[a],
                    k_chunks[b],
                    v_chunks[b],
                    causal=kind is BlockKind.DIAGONAL,
                    scale=scale,
                )
                previous_out, previous_lse = outs[a], lses[a]
                if previous_out is None or previous_lse is None:
                    outs[a], lses[a] = out, lse
                else:
                    outs[a], lses[a] = merge_partials(previous_out, previous_lse, out, lse)
        if pending is not None:
            k_block, v_block = pending.wait()
    done_outs = [out for out in outs if out is not None]
    done_lses = [lse for lse in lses if lse is not None]
    assert len(done_outs) == len(mine), "every query chunk sees at least its own diagonal"
    return torch.cat(done_outs, dim=2).to(q.dtype), torch.cat(done_lses, dim=2)
    # <<< solution


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
    the forward's ``out`` and ``lse``: K/V blocks go around the ring again, and each block's
    dK/dV sum travels with it and comes home."""
    # TODO 2.7: the backward ring loop: dQ stays, dK/dV travel with their block and come home
    # Invariant: every block is computed with the K/V of the step it belongs to and the saved
    #   final out and lse of the queries; dq sums every block's share; the dK/dV of a block
    #   sum the shares of every rank and end on the block's home rank. K/V travel as in the
    #   forward (cp - 1 passes) and so do the dK/dV sums (cp - 1 passes): the home rank's own
    #   share never travels, it waits at home for the sum of the others.
    # Hint 1: at step s the block from the rank s behind visits. Its home rank added its own
    #   share at step 0 and kept it; the others' shares start as zeros on the next rank (step
    #   1) and are passed on after each computation, so the pass after the last step lands on
    #   the block's home rank.
    # Hint 2: cut q, out, grad_out and lse into query chunks; zeros for dq and for this rank's
    #   own dk/dv. Each step: post the K/V pass (not at the last step); pick the dK/dV buffers
    #   the visiting block's shares go into (home's own at step 0, fresh zeros at step 1,
    #   what arrived from the previous rank after that); compute block_attention_backward for
    #   every pair block_kind allows and add each result into its chunk of dq, dk, dv; from
    #   step 1 on, pass those dK/dV buffers on; wait for the K/V pass. After the loop, wait
    #   for the last dK/dV pass and add what came home to this rank's own dk/dv.
    # Hint 3: chunk gives views, so an in-place add_ into the a-th chunk of dq adds into dq
    #   itself (the same for a block's dK/dV sums). Allocate dq and the dK/dV sums (kept and
    #   travelling) with zeros in lse's dtype; cast each returned gradient to its input's
    #   dtype.
    # See guidelines.md#27-context-parallelism
    # >>> solution
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    mine = chunk_ids(rank, cp, zigzag=zigzag)
    n = len(mine)
    q_chunks, out_chunks = q.chunk(n, dim=2), out.chunk(n, dim=2)
    grad_chunks, lse_chunks = grad_out.chunk(n, dim=2), lse.chunk(n, dim=2)
    dtype = lse.dtype
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk_home = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv_home = torch.zeros(v.shape, dtype=dtype, device=v.device)
    k_block, v_block = k, v
    grads_pass = None
    for step in range(cp):
        kv_pass = start_ring_pass([k_block, v_block], group) if step < cp - 1 else None
        if step == 0:
            dk_block, dv_block = dk_home, dv_home  # home's own share stays here
        elif step == 1:
            dk_block, dv_block = torch.zeros_like(dk_home), torch.zeros_like(dv_home)
        else:
            assert grads_pass is not None
            dk_block, dv_block = grads_pass.wait()  # the visiting block's sum so far
        theirs = chunk_ids((rank - step) % cp, cp, zigzag=zigzag)
        k_chunks, v_chunks = k_block.chunk(n, dim=2), v_block.chunk(n, dim=2)
        dq_chunks, dk_chunks, dv_chunks = dq.chunk(n, 2), dk_block.chunk(n, 2), dv_block.chunk(n, 2)
        for a, q_id in enumerate(mine):
            for b, k_id in enumerate(theirs):
                kind = block_kind(q_id, k_id, causal=causal)
                if kind is BlockKind.SKIP:
                    continue
                dq_part, dk_part, dv_part = block_attention_backward(
                    q_chunks[a],
                    k_chunks[b],
                    v_chunks[b],
                    out_chunks[a],
                    lse_chunks[a],
                    grad_chunks[a],
                    causal=kind is BlockKind.DIAGONAL,
                    scale=scale,
                )
                dq_chunks[a].add_(dq_part)
                dk_chunks[b].add_(dk_part)
                dv_chunks[b].add_(dv_part)
        if step > 0:
            grads_pass = start_ring_pass([dk_block, dv_block], group)  # on towards home
        if kv_pass is not None:
            k_block, v_block = kv_pass.wait()
    if grads_pass is not None:  # the sum of the other ranks' shares of this rank's block
        dk_others, dv_others = grads_pass.wait()
        dk_home += dk_others
        dv_home += dv_others
    return dq.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype)
    # <<< solution


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
