"""What ring attention (exercise 2.7) is built from: attention on one block, the ring pass, checks.

Given to the templates of 2.7 (not an exercise). Context parallelism splits the *sequence* of a
self-attention over the ``cp`` ranks of a group: each rank keeps its queries and the keys and
values of its own positions, and the key/value blocks travel around the ring so that every query
meets every key (Liu, Zaharia, Abbeel, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", 2023). What travels and in which order is the exercise; the pieces here
are not:

* :func:`block_attention`: softmax attention of a block of queries over one block of keys,
  returning the output *and* the log-sum-exp (lse) of each query's scores. The lse is what lets
  partial results over different key blocks be merged exactly later (the online softmax of
  Milakov and Gimelshein, "Online normalizer calculation for softmax", 2018, as used by Dao et
  al., "FlashAttention", 2022). ``causal=True`` is the mask of a *diagonal* block: a query block
  and a key block covering the same positions, where query i sees keys j <= i.
* :func:`block_attention_backward`: the gradients of one block given the *final* output and lse of
  those queries (over every key, not just this block): FlashAttention-2's backward (Dao,
  "FlashAttention-2", 2023, Algorithm 2). With the final lse, ``exp(scores - lse)`` is this
  block's share of the true softmax, so the per-block gradients simply add up.
* :func:`start_ring_pass`: send tensors to the next rank of the group and receive the same
  shapes from the previous one, without waiting (``batch_isend_irecv``, which NCCL needs when the
  next and the previous rank are the same, at cp = 2); :meth:`RingPass.wait` returns what
  arrived. Do not modify a tensor you passed until ``wait()`` returned.
* :func:`check_sequence_split` and :func:`check_ring_inputs`: refusals, before any message, of
  sequence lengths that do not split into equal chunks and of mismatched shapes.
* :func:`record_block_work`: counts the blocks a rank computed (and the CPU seconds of the
  calling thread inside them: gloo's own threads, busy with a transfer meanwhile, are not
  counted; with a one-thread CPU rank this is the rank's attention compute) and the ring passes
  it posted and waited for, in order; tests, the demo and the benchmark read it.

Shapes are ``[batch, heads, length, head_dim]`` (as ``scaled_dot_product_attention``). Half
precision inputs are computed, and their outputs and lse returned, in float32.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None

# Hang reports (course/p2p_ledger.py) name the line that called start_ring_pass, not this file.
__p2p_ledger_transparent__ = True


class BlockKind(Enum):
    """What attention needs of one (query chunk, key chunk) block."""

    FULL = "full"  # every query sees every key of the block
    DIAGONAL = "diagonal"  # the same positions: query i sees keys j <= i (the causal mask)
    SKIP = "skip"  # no query sees any key of the block: not computed at all


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types (bf16/fp16), else the dtype itself: where scores and lse live."""
    return torch.promote_types(dtype, torch.float32)


def default_scale(head_dim: int) -> float:
    """``1 / sqrt(head_dim)``, the scale ``scaled_dot_product_attention`` uses by default."""
    return 1.0 / math.sqrt(head_dim)


# ---------------------------------------------------------------------------- one block


def _check_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] + q.shape[3:] != k.shape[:2] + k.shape[3:]:
        raise ValueError(
            "block attention wants q [batch, heads, Lq, d] and k, v [batch, heads, Lk, d]; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"a diagonal (causal) block covers the same positions for queries and keys; got "
            f"{q.shape[2]} queries and {k.shape[2]} keys"
        )


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    dtype = accumulation_dtype(q.dtype)
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-2, -1)) * scale
    if causal:
        length = q.shape[2]
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the queries ``q`` over the keys ``k`` / values ``v`` of one block.

    Returns ``(out, lse)``: ``out`` [B, H, Lq, d] is ``softmax(q k^T * scale) v`` over this
    block's keys only, and ``lse`` [B, H, Lq] is ``log(sum_j exp(score_ij))`` over those keys
    (computed with the max subtracted, so it never overflows). ``causal=True``: a diagonal block
    (same positions), query i sees keys j <= i. ``scale`` defaults to ``1/sqrt(d)``.
    """
    _check_block(q, k, v, causal)
    started = time.thread_time()
    scale = default_scale(q.shape[-1]) if scale is None else scale
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(scores.dtype))
    _record_compute("forward", q, k, causal, started)
    return out, lse


def block_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of dQ, dK, dV, given the queries' *final* ``out`` and ``lse``.

    ``out`` [B, H, Lq, d] and ``lse`` [B, H, Lq] must be those of the whole attention (merged
    over every key block), and ``grad_out`` is dL/d``out``. Returns ``(dq, dk, dv)``: dq is this
    block's contribution to the queries' gradient (add the contributions of every key block), dk
    and dv the contribution of these queries to this key block's gradients (add every query
    block's). With a block's own lse instead of the final one, the result is wrong.
    """
    _check_block(q, k, v, causal)
    if out.shape != q.shape or grad_out.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(
            f"out and grad_out must have the queries' shape {tuple(q.shape)} and lse "
            f"{tuple(q.shape[:3])}; got out {tuple(out.shape)}, grad_out "
            f"{tuple(grad_out.shape)}, lse {tuple(lse.shape)}"
        )
    started = time.thread_time()
    scale = default_scale(q.shape[-1]) if scale is None else scale
    scores = _scores(q, k, causal, scale)
    dtype = scores.dtype
    probs = torch.exp(scores - lse.to(dtype).unsqueeze(-1))  # this block's part of the softmax
    grad_out, out = grad_out.to(dtype), out.to(dtype)
    dv = torch.matmul(probs.transpose(-2, -1), grad_out)
    dprobs = torch.matmul(grad_out, v.to(dtype).transpose(-2, -1))
    delta = (grad_out * out).sum(dim=-1, keepdim=True)  # sum_j P_ij dP_ij, the softmax's Jacobian
    dscores = probs * (dprobs - delta)
    dq = torch.matmul(dscores, k.to(dtype)) * scale
    dk = torch.matmul(dscores.transpose(-2, -1), q.to(dtype)) * scale
    _record_compute("backward", q, k, causal, started)
    return dq, dk, dv


# ---------------------------------------------------------------------------- the ring


def ring_neighbours(group: Group = None) -> tuple[int, int]:
    """GLOBAL ranks of the next and the previous rank in ``group``'s ring (what ``peer=`` wants)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if group is None:
        return (rank + 1) % size, (rank - 1) % size
    return (
        dist.get_global_rank(group, (rank + 1) % size),
        dist.get_global_rank(group, (rank - 1) % size),
    )


@dataclass
class RingPass:
    """Tensors on their way to the next rank, and buffers filling from the previous one."""

    sent: list[torch.Tensor]
    received: list[torch.Tensor]
    works: list[dist.Work]
    done: bool = False

    @torch.compiler.disable  # Works are waited for eagerly, never traced
    def wait(self) -> list[torch.Tensor]:
        """Block until this pass finished both ways; the tensors from the previous rank."""
        if not self.done:
            for work in self.works:
                work.wait()
            self.done = True
            _record_event("wait")
        return self.received


@torch.compiler.disable  # TorchDynamo cannot trace batch_isend_irecv's Works (torch 2.15)
def start_ring_pass(tensors: Sequence[torch.Tensor], group: Group = None) -> RingPass:
    """Post, without waiting: each tensor to the next rank of ``group``, and a receive of the same
    shape and dtype from the previous rank. Every rank of the group must call it, in the same
    order, with the same shapes. Call ``.wait()`` on the result before reading what arrived.

    Not traced when a compiled model calls it (``torch.compiler.disable``): TorchDynamo turns
    the ``Work`` objects ``batch_isend_irecv`` tests into tensors ("Boolean value of Tensor
    with no values is ambiguous", torch 2.15), so the pass runs eagerly between two graphs."""
    if dist.get_world_size(group) < 2:
        raise ValueError("a ring pass needs a group of at least 2 ranks (cp = 1 has no ring)")
    next_rank, previous_rank = ring_neighbours(group)
    sent = [tensor.contiguous() for tensor in tensors]
    received = [torch.empty_like(tensor) for tensor in sent]
    ops = [dist.P2POp(dist.isend, tensor, next_rank, group) for tensor in sent]
    ops += [dist.P2POp(dist.irecv, tensor, previous_rank, group) for tensor in received]
    works = dist.batch_isend_irecv(ops)
    _record_event("post")
    return RingPass(sent, received, list(works))


# ---------------------------------------------------------------------------- checks


def chunk_count(cp: int, zigzag: bool) -> int:
    """How many equal chunks the sequence is cut into: 2·cp (zig-zag) or cp (contiguous)."""
    return 2 * cp if zigzag else cp


def check_sequence_split(length: int, cp: int, zigzag: bool) -> None:
    """Refuse (ValueError) a sequence length that does not cut into equal chunks for ``cp``.

    The message names the length, the chunk count, and both fixes: pad the sequence, or choose
    another cp. Call it before any communication.
    """
    if cp < 1:
        raise ValueError(f"the context-parallel size must be >= 1; got {cp}")
    chunks = chunk_count(cp, zigzag)
    if length < chunks or length % chunks:
        layout = (
            f"the zig-zag layout cuts it into 2·cp = {chunks}"
            if zigzag
            else (f"the contiguous layout cuts it into cp = {chunks}")
        )
        padded = max(chunks, -(-length // chunks) * chunks)
        sizes = [d for d in range(1, min(length, 64) + 1) if length % chunk_count(d, zigzag) == 0]
        other = f"a context-parallel size in {sizes}" if sizes else "another context-parallel size"
        raise ValueError(
            f"sequence length {length} is not divisible into equal chunks for context-parallel "
            f"size {cp}: {layout} equal chunks. Pad the sequence to {padded} (with a causal "
            "mask, padding at the end changes no real position's output; mask the padding "
            f"otherwise) or use {other}"
        )


def check_ring_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks_per_rank: int
) -> None:
    """Refuse (ValueError) local q, k, v that ring attention cannot take, before any message:
    not 4-D [batch, heads, local length, head_dim], not the same shape, or a local length that
    does not hold ``chunks_per_rank`` equal chunks."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            "ring attention takes this rank's q, k, v as [batch, heads, local length, head_dim], "
            f"all of one shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    length = q.shape[2]
    if length < chunks_per_rank or length % chunks_per_rank:
        raise ValueError(
            f"local length {length} does not hold {chunks_per_rank} equal chunks: the global "
            "sequence length must be a multiple of the layout's chunk count (2·cp for zig-zag); "
            "shard it with shard_sequence"
        )


# ---------------------------------------------------------------------------- measuring work


@dataclass(frozen=True)
class BlockCall:
    """One call of :func:`block_attention` (``forward``) or its backward."""

    direction: str
    q_len: int
    k_len: int
    diagonal: bool
    batch_heads: int
    head_dim: int
    seconds: float  # CPU time of the calling thread inside the call (not GPU time)

    @property
    def score_entries(self) -> int:
        """Query-key pairs the block needs: all of them, or the lower triangle of a diagonal."""
        pairs = self.q_len * (self.q_len + 1) // 2 if self.diagonal else self.q_len * self.k_len
        return pairs * self.batch_heads

    @property
    def flops(self) -> int:
        """Needed multiply-adds x2: 4·d per entry forward (q·k and p·v), 10·d backward (5 matmuls,
        FlashAttention-2's count of 2.5x the forward)."""
        per_entry = 4 if self.direction == "forward" else 10
        return per_entry * self.head_dim * self.score_entries


@dataclass
class BlockWork:
    """What one rank did, in order: ``("post"|"wait", None)`` and ``("compute", call)`` events."""

    events: list[tuple[str, BlockCall | None]] = field(default_factory=list)

    def calls(self, direction: str | None = None) -> list[BlockCall]:
        return [
            call
            for kind, call in self.events
            if call is not None and (direction is None or call.direction == direction)
        ]

    def count(self, kind: str) -> int:
        return sum(1 for event, _ in self.events if event == kind)

    def score_entries(self, direction: str | None = None) -> int:
        return sum(call.score_entries for call in self.calls(direction))

    def flops(self, direction: str | None = None) -> int:
        return sum(call.flops for call in self.calls(direction))

    def seconds(self, direction: str | None = None) -> float:
        return sum(call.seconds for call in self.calls(direction))


_RECORDERS: list[BlockWork] = []


@contextmanager
def record_block_work() -> Iterator[BlockWork]:
    """``with record_block_work() as work:`` records every block computed and every ring pass
    posted or waited for in this process while inside the block."""
    work = BlockWork()
    _RECORDERS.append(work)
    try:
        yield work
    finally:
        _RECORDERS.remove(work)


def _record_event(kind: str, call: BlockCall | None = None) -> None:
    for work in _RECORDERS:
        work.events.append((kind, call))


def _record_compute(
    direction: str, q: torch.Tensor, k: torch.Tensor, causal: bool, started: float
) -> None:
    if _RECORDERS:
        call = BlockCall(
            direction,
            q.shape[2],
            k.shape[2],
            causal,
            q.shape[0] * q.shape[1],
            q.shape[3],
            time.thread_time() - started,
        )
        _record_event("compute", call)
