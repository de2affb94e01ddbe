"""Exercise 4.4, part 2: top-k sparsification with error feedback, as a DDP communication hook.

Each rank sends only the k entries of largest magnitude of its gradient bucket (k = ratio x the
bucket's size, per bucket) and keeps the rest in a local memory that is added to the next step's
gradient. Nothing is thrown away, only delayed: Stich, Cordonnier and Jaggi, "Sparsified SGD
with Memory" (NeurIPS 2018) prove that top-k with this error feedback converges at the rate of
plain SGD; Lin et al., "Deep Gradient Compression" (ICLR 2018) train ImageNet models sending
0.1% of the gradient this way (with momentum correction and a warm-up, left out here).

Why all-gather and not all-reduce: the sum of the ranks' sparse vectors is not sparse (each rank
picks other indices), and an all-reduce of dense buffers would send everything. So every rank
all-gathers the (values, indices) pairs of every other rank, k of each per rank, and adds them
into a dense buffer itself. The cost grows with the world: a rank receives (N-1)·k pairs, where a
ring all-reduce of the dense bucket costs 2(N-1)/N of it; top-k wins while k·N stays small
against the bucket.

The hook issues every collective from the hook call itself, waits for them, and returns a
completed future: two collectives per bucket, in bucket order on every rank (see the gloo note in
compression.py).
"""

import math

import torch
import torch.distributed as dist


def topk_count(numel: int, ratio: float) -> int:
    """How many entries a bucket of ``numel`` elements sends: ceil(ratio x numel), at least 1."""
    return max(1, min(numel, math.ceil(ratio * numel)))


class TopKState:
    """What the top-k hook remembers between steps: each bucket's error, and the step count.

    Args:
        group: the data-parallel group (None: the default group).
        ratio: the share of each bucket's entries a rank sends (0 < ratio <= 1).
        start_iter: plain all-reduce for the first ``start_iter`` steps. torch's DDP rebuilds its
            buckets after its first step, so a remembered error from step 0 would not fit the
            new buckets: use ``start_iter >= 2`` there (as torch's PowerSGD requires).

    ``errors[bucket index]`` is the bucket's error: the part of (gradient + previous error) that
    was not sent, a flat tensor of the bucket's size and dtype.
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, ratio: float = 0.01, start_iter: int = 0
    ) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(
                f"top-k ratio {ratio!r} must be in (0, 1]: the share of each bucket sent, e.g. 0.01"
            )
        if start_iter < 0:
            raise ValueError(f"start_iter {start_iter} must be >= 0")
        self.group = group
        self.ratio = ratio
        self.start_iter = start_iter
        self.errors: dict[int, torch.Tensor] = {}
        self.iter = 0

    def error_of(self, bucket: dist.GradBucket) -> torch.Tensor:
        """The bucket's remembered error (zeros the first time)."""
        buffer = bucket.buffer()
        error = self.errors.get(bucket.index())
        if error is None:
            return torch.zeros_like(buffer)
        if error.numel() != buffer.numel():
            raise RuntimeError(
                f"bucket {bucket.index()} has {buffer.numel()} elements but its remembered error "
                f"{error.numel()}: the buckets changed between steps (torch's DDP rebuilds them "
                "after its first step): start compressing at start_iter >= 2"
            )
        return error

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count a step when the last bucket of a backward is handled (torch's rule)."""
        if bucket.is_last():
            self.iter += 1


def sparsify(state: TopKState, bucket: dist.GradBucket) -> tuple[torch.Tensor, torch.Tensor]:
    """Error feedback and selection for one bucket: the (values, indices) this rank sends.

    ``bucket.buffer()`` holds this rank's raw gradients (not divided by the world). The entries
    sent are the k = ``topk_count(bucket size, state.ratio)`` of largest magnitude of gradient +
    remembered error; the new remembered error is that sum minus what is sent.
    """
    # TODO 4.4: add the remembered error, keep the k largest magnitudes, remember the rest.
    # Invariant: new error = gradient + old error - sent, exactly (zeros where sent, the sum
    #   elsewhere); values are the sum's entries at the k indices of largest |sum|; k counts
    #   this bucket's elements, not the model's.
    # Hint 1: state.error_of(bucket) gives the old error; torch.topk on the absolute values
    #   gives the indices; values must keep their sign.
    # Hint 2: first the sum of this step's gradient and what was held back before (a new
    #   tensor: the bucket stays as it is); then how many entries this bucket sends, and which
    #   (largest magnitude); their signed values are what is sent; what is held back now is
    #   that sum with the sent entries zeroed, kept for this bucket's next step.
    # Hint 3: the sum is the bucket's buffer() plus state.error_of the bucket; k is topk_count
    #   of the sum's element count and state.ratio; the indices are those of torch.topk of the
    #   sum's absolute values; the values are the sum at those indices; the new error is a
    #   clone of the sum zeroed there, stored in state.errors under the bucket's index().
    # See guidelines.md#44-gradient-compression
    # >>> solution
    total = bucket.buffer() + state.error_of(bucket)
    k = topk_count(total.numel(), state.ratio)
    indices = total.abs().topk(k, sorted=False).indices
    values = total[indices]
    error = total.clone()
    error[indices] = 0
    state.errors[bucket.index()] = error
    return values, indices
    # <<< solution


def average_sparse(
    values: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Write into ``out`` (dense, flat) the average over ``group`` of every rank's sparse vector
    (``values`` at ``indices``), and return ``out``. Every rank ends with the same bits."""
    # TODO 4.4: all-gather every rank's values and indices, add them into out, divide.
    # Invariant: out = (sum over ranks r of the vector holding values_r at indices_r) / world,
    #   with the same bits on every rank; a rank sends its k values and k indices once.
    # Hint 1: an all-reduce cannot sum sparse vectors: gather the pairs (dist.all_gather or
    #   dist.all_gather_into_tensor, on group) and build the dense sum on every rank.
    # Hint 2: every rank's values and indices gathered on every rank (two gathers); out
    #   cleared; each rank's values added at its indices, rank after rank in the same order
    #   everywhere (an index may come from several ranks, never twice from one); one division
    #   by the group size at the end.
    # Hint 3: dist.all_gather_into_tensor into a flat tensor of world·k elements, from the
    #   contiguous values, on group (the same for the indices); zero out in place; for rank r
    #   from 0 to world − 1, add r's k values into out at r's k indices; divide out in place by
    #   the world size.
    # See guidelines.md#44-gradient-compression
    # >>> solution
    world = dist.get_world_size(group)
    all_values = values.new_empty(world * values.numel())  # flat: gloo wants world x input
    all_indices = indices.new_empty(world * indices.numel())
    dist.all_gather_into_tensor(all_values, values.contiguous(), group=group)
    dist.all_gather_into_tensor(all_indices, indices.contiguous(), group=group)
    out.zero_()
    for rank_values, rank_indices in zip(
        all_values.view(world, -1), all_indices.view(world, -1), strict=True
    ):
        out[rank_indices] += rank_values  # one index at most once per rank: deterministic
    out.div_(world)
    # <<< solution
    return out


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket over ``state.group`` sending k entries per rank.

    Register with ``ddp_model.register_comm_hook(TopKState(group, ratio=0.01), topk_hook)``
    (torch's DDP or ours). Before ``state.start_iter`` steps, a plain averaging all-reduce.
    """
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        state.maybe_increase_iter(bucket)
        buffer.div_(dist.get_world_size(state.group))
        dist.all_reduce(buffer, group=state.group)
        return _completed(buffer)
    values, indices = sparsify(state, bucket)
    average_sparse(values, indices, buffer, group=state.group)
    state.maybe_increase_iter(bucket)
    return _completed(buffer)
