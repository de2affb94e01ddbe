"""Exercise 3.4, part 1: which gradients share a bucket, as torch's DDP Reducer decides.

All-reducing every gradient on its own pays the per-message latency (alpha) once per parameter;
all-reducing everything at once in the end cannot start before backward is over. DDP takes the
middle road (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020, section 3.2.3): gradients are packed into *buckets* of about
``bucket_cap_mb``, and a bucket's all-reduce starts as soon as its last gradient is computed.

Backward produces gradients roughly in reverse order of registration (the last layer's first),
so the buckets are filled walking the parameters from the last registered to the first. The
rule is torch's ``compute_bucket_assignment_by_size`` (torch/csrc/distributed/c10d/reducer.cpp,
exposed as ``dist._compute_bucket_assignment_by_size``), applied as the Reducer applies it when
it rebuilds its buckets after the first iteration, in the order the gradients became ready:

* walk the tensors in order; each joins the open bucket of its kind (dtype and device: one
  bucket is one flat buffer, so it holds one dtype);
* a bucket closes as soon as its bytes reach its limit (so a bucket may exceed the cap by one
  tensor, and a tensor bigger than the cap gets a bucket of its own);
* each kind's first bucket uses ``limits[0]``, its second ``limits[1]``, ..., the last limit
  repeating: torch passes ``[1 MiB, 25 MiB]`` when ``bucket_cap_mb`` is left at its default
  (a small first bucket gets the first all-reduce going early), ``[cap, cap]`` when it is given;
* buckets are listed in the order they closed, then the ones still open at the end (torch lists
  those in the order of a hash map; with one dtype there is exactly one).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch.distributed as dist

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25.0  # torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB


def bucket_size_limits(bucket_cap_mb: float | None) -> list[int]:
    """The byte limits torch's Reducer rebuilds its buckets with.

    ``None`` (torch's default): a first bucket of ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB),
    then 25 MiB buckets. A given cap applies to every bucket, the first included
    (torch/nn/parallel/distributed.py, ``_BucketCapacityConfig.create``).
    """
    if bucket_cap_mb is None:
        return [int(dist._DEFAULT_FIRST_BUCKET_BYTES), int(DEFAULT_BUCKET_CAP_MB * MIB)]
    if bucket_cap_mb < 0:
        raise ValueError(
            f"bucket_cap_mb={bucket_cap_mb} is negative: give a size in MiB (25 is torch's "
            "default; 0 puts every parameter in a bucket of its own)"
        )
    cap = int(bucket_cap_mb * MIB)
    return [cap, cap]


def assign_buckets(
    sizes: Sequence[int], limits: Sequence[int], kinds: Sequence[Hashable] | None = None
) -> list[list[int]]:
    """Bucket membership of parameters ``0 .. n-1`` (registration order) with sizes in bytes.

    Returns the buckets in launch order, each a list of parameter indices in the order their
    gradients are expected (reverse registration order). ``kinds[i]`` (e.g. the dtype) keeps
    parameters of different kinds in different buckets; None means one kind. ``limits`` as
    returned by :func:`bucket_size_limits`.
    """
    if kinds is not None and len(kinds) != len(sizes):
        raise ValueError(f"{len(sizes)} sizes but {len(kinds)} kinds: give one kind per size")
    if not limits:
        raise ValueError("limits is empty: give at least one bucket size limit in bytes")
    kind_of = list(kinds) if kinds is not None else [None] * len(sizes)
    # TODO 3.4: group the parameters into buckets, walking them in reverse registration order.
    # Invariant: every index in exactly one bucket; a bucket holds one kind; a bucket closes as
    #   soon as its bytes reach its limit (the k-th closed bucket of a kind uses limits[k], the
    #   last limit repeating); closed buckets in closing order, then the still-open ones.
    # Hint 1: backward computes the last layer's gradients first: start from index n-1. Keep
    #   one open bucket (indices and bytes) per kind, and per kind how many it has closed.
    # Hint 2: for each index from the last down to 0: add it (and its bytes) to its kind's open
    #   bucket; when that bucket's bytes reach the limit for this kind's next bucket, the
    #   bucket is closed: it goes to the result and its kind starts an empty one. At the end
    #   the buckets still open and not empty follow, in the order their kinds first appeared.
    # Hint 3: the limit for a kind's next bucket is limits at position min(buckets of that
    #   kind closed so far, last position); the bucket closes when its bytes are >= that
    #   limit; per-kind dicts (setdefault, get with 0) hold the open bucket, its bytes, and
    #   the closed count.
    # See guidelines.md#34-ddp-from-scratch
    # >>> solution
    open_buckets: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    closed: dict[Hashable, int] = {}
    result: list[list[int]] = []
    for index in reversed(range(len(sizes))):
        kind = kind_of[index]
        bucket = open_buckets.setdefault(kind, [])
        bucket.append(index)
        open_bytes[kind] = open_bytes.get(kind, 0) + sizes[index]
        limit = limits[min(closed.get(kind, 0), len(limits) - 1)]
        if open_bytes[kind] >= limit:
            result.append(bucket)
            open_buckets[kind], open_bytes[kind] = [], 0
            closed[kind] = closed.get(kind, 0) + 1
    result += [bucket for bucket in open_buckets.values() if bucket]
    return result
    # <<< solution
