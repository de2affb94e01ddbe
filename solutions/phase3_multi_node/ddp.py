"""Exercise 3.4, part 2: ``DistributedDataParallel`` from scratch, a drop-in for torch's.

Phase 1 averaged the gradients after ``backward()`` returned: the network sat idle during
backward, then the processors sat idle during the all-reduce. torch's DDP overlaps the two (Li et
al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020; the
C++ ``Reducer`` in torch/csrc/distributed/c10d/reducer.cpp). So does this module:

1. **Construction** (given, :class:`~phase3_multi_node.ddp_support.DDPBase`): rank 0's
   parameters and buffers are broadcast; the trainable parameters are packed into buckets with
   your :func:`assign_buckets`; a post-accumulate-grad hook on each calls :meth:`_mark_ready`.
2. **During backward** (yours): when a parameter's gradient is in ``.grad``, it goes into its
   slot of its bucket's flat buffer, already divided by the world. When a bucket's last slot is
   filled (and every earlier bucket has been launched), its all-reduce starts, asynchronously,
   while backward goes on computing earlier layers.
3. **When backward ends** (the callback is given, the work is yours: :meth:`_finish_reduction`):
   wait for every bucket and give the averages to ``.grad``. So when ``loss.backward()``
   returns every ``.grad`` holds the average over the group: an ordinary training loop works
   unchanged.

Why divide *before* the sum: the sum of n gradients can overflow fp16 (max 65504) where the
average does not; torch divides while copying into the bucket (reducer.cpp,
``mark_variable_ready_dense``). Why launch buckets *in order*: collectives are matched by the
order they are issued on each rank, so every rank must issue them in the same order, whatever
order its gradients arrive in (``next_bucket_`` in reducer.cpp). phase3_multi_node/ddp_support.py
documents the rest: communication hooks, unused and tied parameters, what differs from torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from phase3_multi_node.ddp_support import DDPBase
from solutions.phase3_multi_node.ddp_buckets import assign_buckets, bucket_size_limits


class DistributedDataParallel(DDPBase):
    """Data parallelism with bucketed all-reduces that overlap backward, like torch's DDP.

    Args:
        module: the model, replicated on every rank of ``group``.
        bucket_cap_mb: bucket size in MiB; None is torch's default (25 MiB, and 1 MiB for the
            first bucket, the one backward fills first).
        group: the data-parallel group (None: the default group).
        find_unused_parameters: allow parameters that get no gradient in a backward (they count
            as zero; one that no rank used keeps its ``.grad`` untouched, like torch). Without
            it such a parameter is an error naming it.
        gradient_as_bucket_view: after backward each ``.grad`` is a view into its bucket (no
            copy back, no second copy of the gradients in memory).
        broadcast_buffers: broadcast the buffers from rank 0 before every forward (torch's
            default), so e.g. BatchNorm's running statistics stay equal.

    ``module`` is an attribute, so ``state_dict()`` keys start with ``module.`` as torch's do.
    What you use of the given base (``DDPBase``): ``self.buckets`` (in launch order; each has
    ``params``, ``slot(position)``, ``pending``, ``work``), ``self.params``, ``self._locate``,
    ``self._next_bucket``, ``self._launch(bucket)``, ``self._copy_factor``,
    ``self.gradient_as_bucket_view`` and ``self.require_backward_grad_sync``.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float | None = None,
        group: dist.ProcessGroup | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__(
            module,
            bucket_size_limits(bucket_cap_mb),  # refuses a negative cap
            assign_buckets,
            group=group,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=broadcast_buffers,
        )

    def _mark_ready(self, index: int) -> None:
        """Copy ``params[index].grad`` (None counts as zeros), divided by the group size, into
        its bucket slot; launch every bucket, in bucket order, whose slots are all filled.

        ``self._locate[index]`` is (bucket, position in it); ``bucket.slot(position)`` is the
        slot; ``bucket.pending`` counts the gradients still to come; ``self._next_bucket`` is
        the first bucket not launched yet; ``bucket.work`` keeps the all-reduce's handle.
        """
        # TODO 3.4: copy the gradient into its bucket (divided by the world) and launch buckets.
        # Invariant: a bucket's all-reduce starts (async, through self._launch) as soon as its
        #   last gradient is in and every earlier bucket has started, never later (overlap) and
        #   never out of bucket order; each bucket is all-reduced once per backward; nothing
        #   here waits for an all-reduce (backward goes on while it runs).
        # Hint 1: scale on the way into the slot, by self._copy_factor (1/world, or 1 when a
        #   hook divides), in one operation that writes straight into the slot: dividing after
        #   the sum lets n fp16 gradients overflow where their average would not.
        # Hint 2: fill the slot (zeros when .grad is None), count the bucket's pending down,
        #   then loop: while the bucket at self._next_bucket has nothing pending, launch it
        #   through self._launch, keep the returned work on the bucket and move
        #   self._next_bucket on. Do not wait here: the callback waits when backward ends.
        # Hint 3: torch.mul of the gradient and the copy factor with out= the slot; then, as
        #   long as the next bucket index is within the bucket list and that bucket has no
        #   gradient pending, store self._launch's work on it and advance the index.
        # See guidelines.md#34-ddp-from-scratch
        # >>> solution
        bucket, position = self._locate[index]
        slot = bucket.slot(position)
        grad = self.params[index].grad
        if grad is None:
            slot.zero_()
        else:
            torch.mul(grad, self._copy_factor, out=slot)  # divide before the sum, no temporary
        bucket.pending -= 1
        while self._next_bucket < len(self.buckets):
            ready = self.buckets[self._next_bucket]
            if ready.pending > 0:
                break
            ready.work = self._launch(ready)
            self._next_bucket += 1
        # <<< solution

    def _finish_reduction(self) -> None:
        """Wait for every bucket's all-reduce, put the averages in ``.grad``, reset the state
        of this backward so the next one starts afresh."""
        # TODO 3.4: wait for the all-reduces, write the averaged gradients, reset for next step.
        # Invariant: when backward returns every .grad holds the group's average (a copy, or
        #   with gradient_as_bucket_view the bucket slot itself); every bucket is again
        #   waiting for all its gradients and no all-reduce is remembered from this step.
        # Hint 1: an async all-reduce's result is in the buffer only after its work's wait();
        #   the next backward counts and launches from scratch, so everything _mark_ready
        #   changed must be put back.
        # Hint 2: When is an async all-reduce's result in its buffer? For each parameter, what
        #   should .grad become: the bucket's slot itself, or a copy of it, and what if .grad is
        #   None? Which counters and handles did _mark_ready change during this backward, and what
        #   must the next backward find in them?
        # Hint 3: For each bucket: wait for its work; for each of its parameters take its slot and
        #   either make it the .grad (gradient_as_bucket_view), or copy it into .grad (a new tensor
        #   when .grad is None); then its pending count back to its number of parameters and its
        #   work forgotten. Finally the next bucket to launch is 0 again.
        # See guidelines.md#34-ddp-from-scratch
        # >>> solution
        for bucket in self.buckets:
            bucket.work.wait()
            for position, index in enumerate(bucket.params):
                param, slot = self.params[index], bucket.slot(position)
                if self.gradient_as_bucket_view:
                    param.grad = slot
                elif param.grad is None:
                    param.grad = slot.clone()
                else:
                    param.grad.copy_(slot)
            bucket.pending = len(bucket.params)
            bucket.work = None
        self._next_bucket = 0
        # <<< solution

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates into ``.grad``; the first backward of a forward run
        outside all-reduces the accumulated sum (torch's ``DistributedDataParallel.no_sync``)."""
        # TODO 3.4: switch gradient synchronization off inside the block, restore it after.
        # Invariant: forwards run inside the block build backwards that do not communicate;
        #   after the block (also when it raises) synchronization is as it was before.
        # Hint 1: forward reads self.require_backward_grad_sync to decide.
        # Hint 2: What if the body of the with-block raises: does synchronization still come back?
        #   What if no_sync is used inside another no_sync: which value must the inner one restore
        #   when it ends?
        # Hint 3: Remember the old value of require_backward_grad_sync, set it to False, yield
        #   inside a try, and put the old value back in its finally (so no_sync nested in no_sync
        #   stays off until the outer one ends).
        # See guidelines.md#34-ddp-from-scratch
        # >>> solution
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
        # <<< solution
