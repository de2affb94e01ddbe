"""Exercise 4.4, part 2: top-k sparsification with error feedback, as a DDP communication hook.

Each rank sends only k entries of its gradient bucket (k = ratio x the bucket's size, per
bucket) and keeps what it did not send in a local memory. Nothing is thrown away, only
delayed: Stich, Cordonnier and Jaggi, "Sparsified SGD with Memory" (NeurIPS 2018) prove that
top-k with this error feedback converges at the rate of plain SGD; Lin et al., "Deep Gradient
Compression" (ICLR 2018) train ImageNet models sending 0.1% of the gradient this way (with
momentum correction and a warm-up, left out here).

The hook issues every collective from the hook call itself, waits for them, and returns a
completed future, in bucket order on every rank (see the gloo note in compression.py).
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

    ``bucket.buffer()`` holds this rank's raw gradients (not divided by the world). It sends
    k = ``topk_count(bucket size, state.ratio)`` entries and remembers, in ``state.errors``
    under the bucket's index, everything it did not send.
    """
    # TODO 4.4: choose the k entries this rank sends, and remember what it holds back.
    # Invariant: nothing is lost, only delayed: the values sent plus the new error equal this step's
    #   gradient plus the old error, exactly (zeros where sent); the new error is stored in
    #   state.errors under the bucket's index; k is topk_count of the bucket's size and the ratio.
    # Hint 1: state.error_of(bucket) is what this bucket held back last time; torch.topk finds the k
    #   largest entries of a tensor.
    # Hint 2: From which tensor are the k entries chosen, so that what was held back is sent some
    #   day? Largest by which measure: is an entry of -5 less worth sending than one of 3? Which
    #   sign does a value sent keep? What is held back at the places sent, and everywhere else?
    # Hint 3: the choice is made on this step's gradient plus the old error (a new tensor, the sum),
    #   never on the gradient alone: an entry held back grows there until it is sent.
    # Hint 4: largest by magnitude: torch.topk of the sum's absolute values gives the indices; the
    #   values sent are the sum's own signed entries at those indices.
    # Hint 5: In words: the sum of the bucket's buffer and its old error; k from topk_count of the
    #   sum's size and the ratio; the indices of the k largest absolute values; the sum's values
    #   there; the new error is a copy of the sum with those places zeroed, stored in state.errors
    #   under the bucket's index; return the values and the indices.
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
    # TODO 4.4: give every rank the group's average of every rank's sparse vector.
    # Invariant: out = (sum over the ranks r of the vector holding values_r at indices_r) / world,
    #   with the same bits on every rank; a rank hands k float32 values and k int64 indices to the
    #   network once per bucket, and no dense tensor.
    # Hint 1: the ranks chose different indices: what does the sum of two sparse vectors look like?
    # Hint 2: Why can an all-reduce not add sparse vectors for fewer bytes than the dense bucket?
    #   What must every rank receive from every other, and which collective hands every rank each
    #   rank's tensor? Each rank then adds the pairs into out itself: in which order of ranks, so
    #   that every rank rounds the same way?
    # Hint 3: the collective: dist.all_gather_into_tensor on group, once for the values and once for
    #   the indices, into flat tensors of world times k elements (rank r's pairs are the r-th block
    #   of k).
    # Hint 4: the order: out cleared, then rank 0's values added at rank 0's indices, then rank 1's,
    #   and so on, the same on every rank. Float addition is not associative: a rank that added its
    #   own values first would end a bit apart wherever three ranks chose one index. Within one rank
    #   an index appears once, so each rank's addition is plain.
    # Hint 5: In words: gather every rank's values and indices into two flat tensors; zero out; for
    #   each rank in order, add its k values into out at its k indices; divide out by the world size
    #   once.
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
