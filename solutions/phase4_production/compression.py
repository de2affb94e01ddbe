"""Exercise 4.4: gradient compression as DDP communication hooks (part 1: fp16/bf16, the factory).

A DDP communication hook replaces the all-reduce of one gradient bucket (torch's
``DistributedDataParallel.register_comm_hook``; ours in phase 3 has the same seam)::

    hook(state, bucket) -> torch.futures.Future[Tensor]

``bucket.buffer()`` holds this rank's raw gradients (flat, one dtype, *not* divided by the
world: a hook divides); ``bucket.gradients()`` are views into it, one per parameter;
``bucket.index()`` and ``bucket.is_last()`` say which bucket it is. The tensor the future
returns becomes the bucket's averaged gradient on every rank. Three ways to send less:

* **fp16 / bf16** (this module): the bucket travels in 16 bits: half the bytes, the same
  algorithm; equal bit for bit to torch's ``default_hooks.fp16_compress_hook`` /
  ``bf16_compress_hook``.
* **top-k with error feedback** (``compression_topk.py``): send the k largest entries and
  remember the rest.
* **PowerSGD** (``compression_powersgd.py``): send rank-r factors of each weight's gradient.

**The gloo pitfall, and the rule these hooks follow.** Collectives are matched by the order each
rank issues them. torch's ``powerSGD_hook`` issues its second and third all-reduces from
``Future.then`` callbacks; gloo completes futures on its own threads, so with several buckets in
flight rank 0 may issue bucket 1's Q all-reduce before bucket 2's P all-reduce while rank 1 does
the opposite: a hang. Here every collective is issued from the hook call itself, which DDP makes
on every rank in bucket order: the hook waits for each result it needs before the next
collective and returns a completed future. The price is overlap: backward stops while a
bucket's multi-round exchange runs. A hook with a single collective (fp16) may still return its
async future: a callback that only *computes* (casts back) is safe.

``make_comm_hook`` picks a method by name, for trainers::

    hook = make_comm_hook("powersgd", powersgd_rank=2)
    if hook is not None:
        ddp_model.register_comm_hook(*hook)
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from solutions.phase4_production.compression_powersgd import PowerSGDState, powersgd_hook
from solutions.phase4_production.compression_topk import TopKState, topk_hook

METHODS = ("none", "fp16", "bf16", "topk", "powersgd")
CommHook = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]


def cast_compress_hook(
    dtype: torch.dtype, group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ``group`` in ``dtype`` (16 bits) and write it back in place.

    The future's value is ``bucket.buffer()`` itself, holding the average in the bucket's dtype.
    """
    # TODO 4.4: average the bucket over group in 16 bits, as torch's fp16/bf16 hooks do, in place.
    # Invariant: the bucket's buffer ends with, bit for bit, what torch's
    #   default_hooks.fp16_compress_hook (float16) or bf16_compress_hook (bfloat16) gives, in the
    #   buffer's own dtype, entries of 40000 on 3 ranks included; one all-reduce of 2 bytes per
    #   element; the future's value is the buffer; what runs when the sum arrives starts no
    #   collective.
    # Hint 1: fp16's largest value is 65504, and a division by 3 is not exact in 16 bits.
    # Hint 2: Three ranks each hold 40000: what does their fp16 sum become? So does the division by
    #   the world come before the all-reduce or after it, and in which dtype, 16 bits or the
    #   bucket's? Which does torch's default_hooks.py do first, the cast or the division? What may
    #   the function chained on the all-reduce's future do, and what must it not?
    # Hint 3: the division comes before the sum: each rank's share of the average cannot overflow
    #   where the sum of the ranks' values would.
    # Hint 4: the cast comes first, then the division, in 16 bits, as default_hooks does: dividing
    #   in the bucket's dtype and casting afterwards rounds once where torch rounds twice, and on 3
    #   ranks some entries end one bit apart.
    # Hint 5: the all-reduce runs with async_op set; its Work's get_future, chained with then, runs
    #   a function of the finished future that copies the future's value (its first tensor) into the
    #   buffer, which casts it back, and returns the buffer. That function only computes.
    # Hint 6: In words: a 16-bit copy of the buffer, divided in place by the group's size; an
    #   asynchronous dist.all_reduce of it on group; return its future chained with a function that
    #   copies the summed tensor back into the bucket's buffer and returns the buffer.
    # See guidelines.md#44-gradient-compression
    # >>> solution
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done: torch.futures.Future[Any]) -> torch.Tensor:
        return buffer.copy_(done.value()[0])

    return future.then(decompress)
    # <<< solution


def fp16_hook(
    group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average in float16 (half the bytes); the state is the process group, as torch's."""
    return cast_compress_hook(torch.float16, group, bucket)


def bf16_hook(
    group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average in bfloat16 (half the bytes, fp32's range); the state is the process group."""
    return cast_compress_hook(torch.bfloat16, group, bucket)


def make_comm_hook(
    name: str,
    group: dist.ProcessGroup | None = None,
    *,
    topk_ratio: float = 0.01,
    powersgd_rank: int = 2,
    start_iter: int = 10,
    seed: int = 0,
) -> tuple[Any, CommHook] | None:
    """(state, hook) for ``ddp_model.register_comm_hook(state, hook)``; None for "none".

    ``name`` is one of :data:`METHODS`. ``start_iter``: plain all-reduce for the first steps
    (top-k and PowerSGD; PowerSGD needs >= 2); ``seed``: PowerSGD's first random Q.
    """
    if name not in METHODS:
        raise ValueError(f"unknown compression {name!r}: choose one of {', '.join(METHODS)}")
    if name == "none":
        return None
    if name == "fp16":
        return group, fp16_hook
    if name == "bf16":
        return group, bf16_hook
    if name == "topk":
        return TopKState(group, ratio=topk_ratio, start_iter=start_iter), topk_hook
    state = PowerSGDState(group, rank=powersgd_rank, start_iter=start_iter, seed=seed)
    return state, powersgd_hook
