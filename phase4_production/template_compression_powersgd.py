# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase4.py
"""Exercise 4.4, part 3: PowerSGD, low-rank gradient compression, as a DDP communication hook.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019), Algorithm 1; the same steps as torch's
``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``. Each gradient matrix M (n x m:
a layer's weight, viewed as ``shape[0] x rest``) is replaced by the group's average of a rank-r
approximation, found by one step of power iteration that every rank takes together, from the
products P = M Q (n x r) and Q = Mᵀ P (m x r), with M ≈ P Qᵀ at the end. A rank sends the
factors instead of the matrix. Q is kept for the next step (warm start: one power-iteration step
per training step, converging over the steps), and what the approximation missed is kept
locally and added to the next gradient (error feedback, as in top-k). Only the matrices
``should_compress`` accepts are compressed; the others (biases, small layers) are all-reduced as
they are. The first ``start_iter`` steps use a plain all-reduce, as torch's hook does.

Unlike torch's hook, which issues the Q all-reduce from the P all-reduce's future callback, this
one issues every collective from the hook call itself, in a fixed order: under gloo a future's
callbacks run on gloo's threads, so with several buckets two ranks could issue their collectives
in different orders and hang (compression.py explains the trade-off: less overlap).
"""

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist


class PowerSGDState:
    """PowerSGD's settings and memory, shared by all buckets (torch's ``PowerSGDState``).

    Args:
        group: the data-parallel group (None: the default group).
        rank: r, the rank of the approximation (torch's ``matrix_approximation_rank``).
        start_iter: plain all-reduce for the first ``start_iter`` steps (``start_powerSGD_iter``;
            at least 2 with error feedback or warm start: torch's DDP rebuilds its buckets after
            the first step).
        min_compression_rate: compress a matrix only if it shrinks by more than this.
        use_error_feedback, warm_start: as in the paper; both on by default.
        orthogonalization_epsilon: added to each column's norm (0: none).
        seed: seeds the draws of the first Q of each bucket, the same on every rank (torch draws
            its seeds with ``numpy.random.RandomState(seed)``; so does this class, so both hooks
            start from the same Q).

    Memory per bucket index: ``errors`` (flat, the bucket's size), ``p_memory`` and
    ``q_memory`` (flat: every compressed matrix's P, resp. Q, one after the other).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        rank: int = 1,
        start_iter: int = 10,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        seed: int = 0,
    ) -> None:
        if rank < 1:
            raise ValueError(f"PowerSGD rank {rank} must be >= 1 (1, 2 or 4 are typical)")
        if (use_error_feedback or warm_start) and start_iter <= 1:
            raise ValueError(
                f"start_iter {start_iter} must be >= 2 with error feedback or warm start: torch's "
                "DDP rebuilds its buckets after the first step, so memory kept before that would "
                "not fit the new buckets"
            )
        self.group = group
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(seed)
        self.errors: dict[int, torch.Tensor] = {}
        self.p_memory: dict[int, torch.Tensor] = {}
        self.q_memory: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def compression_stats(self) -> tuple[float, int, int]:
        """(compress rate, numel before, numel after) summed over every compressed step and
        bucket, as torch's ``PowerSGDState.compression_stats()`` (rate 0 before any)."""
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0, before, after)

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count a step when the last bucket of a backward is handled (torch's rule)."""
        if bucket.is_last():
            self.iter += 1

    def fill_random(self, qs: Sequence[torch.Tensor]) -> None:
        """Fill each Q with standard normal draws from one seed per call, drawn from
        ``self.rng``: the same values on every rank, and the same as torch's hook draws."""
        generator = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
        for q in qs:
            q.copy_(torch.randn(*q.shape, generator=generator, dtype=q.dtype))


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """Whether a rows x cols matrix is worth sending as rank-``rank`` factors (torch's rule)."""
    # TODO 4.4: decide whether the factors are small enough to be worth it.
    # Invariant: the same answer as torch's _should_compress (powerSGD_hook.py) for every rows,
    #   cols, rank and rate, the equal cases included.
    # Hint 1: the factors P and Q are what would be sent instead of the matrix; the minimum rate
    #   says how much cheaper they must be to be worth the approximation.
    # More hints: uv run python -m tests.hint 4.4
    # See guidelines.md#44-gradient-compression
    raise NotImplementedError(
        "TODO 4.4: decide whether the factors are small enough to be worth it "
        "(see phase4_production/guidelines.md#44-gradient-compression)"
    )


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of ``matrix`` (n x r, r <= n) orthonormal, in place, by Gram-Schmidt.

    As torch's ``_orthogonalize`` (powerSGD_hook.py) does for r <= 2, and ``torch.linalg.qr``'s
    Q up to column signs; ``epsilon`` (torch's ``orthogonalization_epsilon``) keeps a zero
    column finite.
    """
    # TODO 4.4: Gram-Schmidt on the columns, in place.
    # Invariant: afterwards matrixᵀ·matrix is the identity (to rounding); torch.linalg.qr's Q up to
    #   column signs; torch's _orthogonalize for r <= 2; with epsilon, a zero column stays finite;
    #   the matrix itself changed (the hook works on views of its memories).
    # Hint 1: Gram-Schmidt, one column at a time; torch's _orthogonalize_gram_schmidt
    #   (powerSGD_hook.py) is the reference for r <= 2.
    # More hints: uv run python -m tests.hint 4.4
    # See guidelines.md#44-gradient-compression
    raise NotImplementedError(
        "TODO 4.4: Gram-Schmidt on the columns, in place "
        "(see phase4_production/guidelines.md#44-gradient-compression)"
    )


def factor_views(memory: torch.Tensor, shapes: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Consecutive views of the flat ``memory``, one per (rows, r) shape (P's or Q's)."""
    views, start = [], 0
    for rows, rank in shapes:
        views.append(memory[start : start + rows * rank].view(rows, rank))
        start += rows * rank
    return views


def low_rank_average(
    state: PowerSGDState,
    index: int,
    matrices: Sequence[torch.Tensor],
    ranks: Sequence[int],
    *,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Overwrite each of ``matrices`` (views into bucket ``index``) with P Qᵀ, the rank-
    ``ranks[i]`` approximation of the group's average, by one step of power iteration.

    ``state.p_memory[index]`` and ``state.q_memory[index]`` hold every matrix's P and Q, flat, in
    the order of ``matrices`` (see :func:`factor_views`); Q survives to the next step.
    """
    world = dist.get_world_size(group)
    p_shapes = [(m.shape[0], r) for m, r in zip(matrices, ranks, strict=True)]
    q_shapes = [(m.shape[1], r) for m, r in zip(matrices, ranks, strict=True)]
    # TODO 4.4: replace each matrix by the group's rank-r approximation (one power step).
    # Invariant: every matrix ends as its P·Qᵀ, the same bits on every rank, equal to torch's
    #   powerSGD_hook (1e-9) step after step with the same seed, and the kept Q equal to torch's (up
    #   to column signs); p_memory and q_memory hold the factors flat, in factor_views' layout; a
    #   bucket's first Q comes from state.fill_random, later ones continue from the kept Q when
    #   state.warm_start; every collective runs on group.
    # Hint 1: P = M·Q and Q = Mᵀ·P are linear in M: think of what a sum over the ranks of either is.
    # More hints: uv run python -m tests.hint 4.4
    # See guidelines.md#44-gradient-compression
    raise NotImplementedError(
        "TODO 4.4: replace each matrix by the group's rank-r approximation (one power step) "
        "(see phase4_production/guidelines.md#44-gradient-compression)"
    )


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def _split(
    state: PowerSGDState, gradients: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]]:
    """(matrices to compress, their ranks, tensors to all-reduce as they are), counting the
    statistics as torch does. Matrices are grouped by shape in order of first appearance, the
    order torch's hook gives them (so the random first Qs are drawn in the same order)."""
    by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    uncompressed = []
    for tensor in gradients:
        matrix = tensor.view(tensor.shape[0], -1)
        n, m = matrix.shape
        rank = min(n, m, state.rank)
        state.total_numel_before_compression += n * m
        if should_compress(n, m, rank, state.min_compression_rate):
            by_shape.setdefault((n, m), []).append(matrix)
            state.total_numel_after_compression += (n + m) * rank
        else:
            uncompressed.append(tensor)
            state.total_numel_after_compression += n * m
    matrices = [matrix for group in by_shape.values() for matrix in group]
    ranks = [min(*matrix.shape, state.rank) for matrix in matrices]
    return matrices, ranks, uncompressed


def powersgd_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: PowerSGD on the bucket's matrices, a plain average for the rest.

    Register with ``ddp_model.register_comm_hook(PowerSGDState(group, rank=2), powersgd_hook)``
    (torch's DDP or ours). Every collective is issued and waited for here, in the same order on
    every rank; the returned future is already complete.
    """
    group = state.group
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        state.maybe_increase_iter(bucket)
        buffer.div_(world)
        dist.all_reduce(buffer, group=group)
        return _completed(buffer)
    index = bucket.index()
    if state.use_error_feedback and index in state.errors:
        buffer.add_(state.errors[index])
    before = buffer.clone() if state.use_error_feedback else None  # what this rank would send
    matrices, ranks, uncompressed = _split(state, bucket.gradients())
    flat = torch.cat([tensor.view(-1) for tensor in uncompressed]) if uncompressed else None
    # the plain part starts first and finishes while P and Q travel
    pending = dist.all_reduce(flat, group=group, async_op=True) if flat is not None else None
    if matrices:
        low_rank_average(state, index, matrices, ranks, group=group)
    if flat is not None and pending is not None:
        pending.wait()
        flat.div_(world)
        for tensor, part in zip(
            uncompressed, flat.split([t.numel() for t in uncompressed]), strict=True
        ):
            tensor.copy_(part.view_as(tensor))
    if before is not None:
        state.errors[index] = before - buffer
    if not state.warm_start:
        state.p_memory.clear()
        state.q_memory.clear()
    state.maybe_increase_iter(bucket)
    return _completed(buffer)
