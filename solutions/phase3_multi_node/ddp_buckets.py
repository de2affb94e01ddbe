"""Exercise 3.4, part 1: which gradients share a bucket, as torch's DDP Reducer decides.

All-reducing every gradient on its own pays the per-message latency (alpha) once per parameter;
all-reducing everything at once in the end cannot start before backward is over. DDP takes the
middle road (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020, section 3.2.3): gradients are packed into *buckets* of about
``bucket_cap_mb``, and a bucket's all-reduce starts as soon as its last gradient is computed.

The rule is torch's ``compute_bucket_assignment_by_size`` (torch/csrc/distributed/c10d/reducer.cpp,
exposed as ``dist._compute_bucket_assignment_by_size``), which the Reducer applies when it
rebuilds its buckets after the first iteration, handed the tensors in the order their gradients
became ready:

* one bucket is one flat buffer, so it holds one kind (dtype and device);
* a bucket is full as soon as its bytes reach its limit (so a bucket may pass the limit by one
  tensor, and a tensor bigger than the limit gets a bucket of its own);
* a kind's first bucket uses the first limit, its second bucket the second, the last limit
  repeating: torch passes ``[1 MiB, 25 MiB]`` when ``bucket_cap_mb`` is left at its default
  (a small first bucket gets the first all-reduce going early), ``[cap, cap]`` when it is given;
* buckets are listed in the order they filled, then the ones still open at the end (torch lists
  those in the order of a hash map; ours in the order their kinds first appear).

Which order the gradients become ready in is yours to work out (guidelines.md#34-ddp-from-scratch).
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
    gradients are expected from a chain's backward. ``kinds[i]`` (e.g. the dtype) keeps
    parameters of different kinds in different buckets; None means one kind. ``limits`` as
    returned by :func:`bucket_size_limits`.
    """
    if kinds is not None and len(kinds) != len(sizes):
        raise ValueError(f"{len(sizes)} sizes but {len(kinds)} kinds: give one kind per size")
    if not limits:
        raise ValueError("limits is empty: give at least one bucket size limit in bytes")
    kind_of = list(kinds) if kinds is not None else [None] * len(sizes)
    # TODO 3.4: group the parameters into the buckets torch rebuilds after its first iteration
    # Invariant: every index in exactly one bucket, one kind per bucket; for a chain of layers
    #   the result equals dist._compute_bucket_assignment_by_size handed the parameters in the
    #   order the chain's backward makes their gradients ready (the rule: module docstring).
    # Hint 1: which layer's gradients does backward compute first?
    # Hint 2: Which index does your walk start from, and why? With parameters of two kinds
    #   interleaved, how many buckets can be open at once, and what must each kind remember
    #   from one parameter to the next? Does the parameter whose bytes reach the limit end
    #   the bucket it joined, or start the next one?
    # Hint 3: the walk starts at index n-1 and goes down to 0: backward reaches the last
    #   layer first, and the buckets must fill in the order the gradients arrive.
    # Hint 4: every kind has its own open bucket, its bytes so far, and its count of closed
    #   buckets; that count picks the kind's limit in the list of limits, the last entry once
    #   the count runs past the end. A parameter joins first, then the bytes are compared.
    # Hint 5: for each index from the last down to the first, append it to its kind's open
    #   bucket and add its bytes; if they now reach that kind's limit, move the bucket to the
    #   result, give the kind a fresh empty one and count one more closed. At the end append
    #   every open bucket that is not empty, kinds in the order they first appeared.
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
