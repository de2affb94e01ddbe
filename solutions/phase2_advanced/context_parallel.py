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
from solutions.phase2_advanced.context_parallel_layout import block_kind, chunk_ids


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
    # Hint 2: What is the denominator of A, as a function of lse_a, and what is its numerator,
    #   from out_a and lse_a? What are the union's? An exponential overflows float32 above 88:
    #   by which common factor can you multiply the union's numerator and denominator so that
    #   every exponent is at most zero? The out tensors have one more dimension than the lse
    #   tensors: how do the weights meet head_dim?
    # Hint 3: The union's denominator is the sum of the two exponentials of the lse; its
    #   numerator is the sum of each out times the exponential of its own lse. So the merged
    #   lse is the log of that sum, and the merged out is the weighted mix of the two outs.
    # Hint 4: Factor out the exponential of the larger of the two lse (element-wise,
    #   torch.maximum): each weight becomes the exponential of its lse minus that maximum, one
    #   of them exactly 1, the other at most 1, and their sum lies between 1 and 2.
    # Hint 5: With the element-wise maximum of the two lse and the two weights of Hint 4: the
    #   merged lse is the maximum plus the log of the summed weights; the merged out is the sum
    #   of each out times its weight, divided by the summed weights, every weight given a last
    #   dimension of size 1 (unsqueeze) so that it broadcasts over head_dim.
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
    # Invariant: every local query chunk merges exactly the blocks block_kind asks for, from
    #   every rank's K/V, each computed once; returns (out in q's dtype, lse in the
    #   accumulation dtype) over every key of the sequence; the transfers hide behind the
    #   compute: every block is computed while a ring pass is in flight, except on the last
    #   step, which passes nothing; cp - 1 passes in all.
    # Hint 1: the queries stay and the K/V blocks move; the guide's step table shows which
    #   block each rank holds at each step.
    # Hint 2: At step s, on which rank did the block this rank holds start, and which chunks
    #   does it hold? For which (query chunk, key chunk) pairs do you compute, and with which
    #   mask? Where does each result go, and what is a query chunk's result before its first
    #   block? When can the block you hold leave for the next rank without this rank waiting
    #   for the wire, and when must the next block be here?
    # Hint 3: The block held at step s started on the rank s places behind this one in the
    #   ring (modulo cp); its chunks are chunk_ids of that rank, and it is cut into that many
    #   pieces along the sequence (dimension 2), as q is cut into this rank's chunks.
    # Hint 4: Each pair that block_kind does not skip goes through block_attention, with the
    #   causal mask only on a DIAGONAL block, and is merged into its query chunk's running
    #   (out, lse); a chunk's first result is taken as it is.
    # Hint 5: The block held now is passed on (start_ring_pass of its k and v) before this rank
    #   computes on it, except on the last step; the pass is waited for after the step's
    #   blocks, and what it brings is the next step's block.
    # Hint 6: For each step from 0 to cp − 1: post the pass of the block held (not on the last
    #   step); find the block's home rank and chunk ids and cut its k and v into chunks;
    #   compute and merge every needed pair; wait for the pass and hold what arrived. Then
    #   concatenate the query chunks' outs along dimension 2, cast to q's dtype, and their
    #   lses, left in the accumulation dtype.
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
    the forward's ``out`` and ``lse``, by a second ring over ``group``."""
    # TODO 2.7: the backward ring loop: every share of dQ, dK and dV reaches its owner
    # Invariant: dq sums the shares of every block this rank's queries met; dk and dv sum the
    #   shares of every rank's queries in this rank's K/V; all three are accumulated in lse's
    #   dtype and returned in the dtypes of q, k and v; every block is computed with the K/V of
    #   its own step and the saved final out and lse; this rank sends 2(cp − 1) times the bytes
    #   of its K and V in all, no more.
    # Hint 1: the K/V blocks visit every rank again, as in the forward. A block's dQ share
    #   belongs to the queries here; its dK/dV share belongs to the block's home rank.
    # Hint 2: The K/V passes alone cost cp − 1 times this rank's K and V: what is left of the
    #   byte budget for the dK/dV shares? Can each rank send every share home on its own
    #   within it? What could travel with the block instead, collecting the shares on its way?
    #   At which step does such a sum start, on which rank is it after the last step, and what
    #   does the home rank hold of its own meanwhile?
    # Hint 3: dQ stays: every block's dq share is added into this rank's dq. The dK/dV shares
    #   of a block travel one step behind the block, as a running sum passed from rank to
    #   rank, each rank adding its share.
    # Hint 4: The home rank's own share (step 0) never travels. The sum of the others starts
    #   as zeros on the next rank (step 1); from step 2 on, a rank adds its share to the sum
    #   that just arrived; every step but step 0 passes its sum on, so the pass after the last
    #   step lands on the home rank, which adds it to the share it kept.
    # Hint 5: chunk gives views, so an in-place add into the a-th chunk of dq adds into dq
    #   itself (the same for a block's dK/dV sums); allocate dq and the sums with zeros in
    #   lse's dtype; never write into a tensor whose pass is in flight; cast each returned
    #   gradient to its input's dtype.
    # Hint 6: Cut q, out, grad_out and lse into query chunks. For each step: post the K/V pass
    #   (not on the last step); take the dK/dV sum of the block held (home's own at step 0,
    #   fresh zeros at step 1, the one that arrived after that); for every pair block_kind
    #   allows, block_attention_backward of the query chunk's q, out, lse and incoming
    #   gradient against the key chunk's k and v, its three results added into the chunks of
    #   dq and of the sum; from step 1 on, pass the sum on; wait for the K/V pass. After the
    #   loop, wait for the last dK/dV pass and add what came home to this rank's own dk, dv.
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
